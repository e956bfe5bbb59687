"""A ``LightningCLI`` script in the CLI's ``run=True`` form, shaped like Lightning's
``examples/pytorch/basics/backbone_image_classifier.py`` (written for these tests, data synthetic): a
``Backbone``, a ``LitClassifier(backbone, learning_rate)`` that logs its losses, a ``MyDataModule(batch_size)``
splitting a dataset with a seeded generator, ``LightningCLI(LitClassifier, MyDataModule,
seed_everything_default=1234, save_config_kwargs={"overwrite": True})``, the default logger and
``ModelCheckpoint``. What is added is the documented lines: ``FaultTolerance`` given on the command line
(``--trainer.callbacks+=fault_tolerant_handlers.lightning.FaultTolerance``) and the CLI's ``before_fit``
hook passing ``latest_checkpoint(self.trainer)`` as ``fit``'s ``ckpt_path`` (``docs/lightning.md``).

    torchrun --nproc-per-node 2 [--max-restarts 1] user_lightning_cli_main.py OUTDIR

runs ``fit`` with the command line of :data:`COMMAND` (what a user would type after the script's name).
Each rank records JSON lines in ``OUTDIR/rank<R>.jsonl`` (``asked``: what ``latest_checkpoint`` gave;
``resumed``: the global step training started at; ``done``); rank 0 saves its final weights in
``OUTDIR/weights.pt``; ``OUTDIR/attempt<A>.0_rank<R>.json`` names the process (the test's cleanup).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

from fault_tolerant_handlers import latest_checkpoint

OUT = Path(sys.argv[1]) if __name__ == "__main__" else Path(".")
RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
#: The command line after the script's name: 10 steps an epoch on each of 2 ranks, 3 epochs.
COMMAND = ["fit", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
           "--trainer.max_epochs=3", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
           "--trainer.log_every_n_steps=5", f"--trainer.default_root_dir={OUT}",
           "--trainer.callbacks+=fault_tolerant_handlers.lightning.FaultTolerance", "--data.batch_size=8"]


def record(event: str, **fields) -> None:
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "rank": RANK, "attempt": ATTEMPT, "t": time.time(), **fields},
                           default=str) + "\n")


class Backbone(torch.nn.Module):
    def __init__(self, hidden_dim: int = 32) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(28 * 28, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        return torch.relu(self.l2(torch.relu(self.l1(x))))


class LitClassifier(LightningModule):
    def __init__(self, backbone: Optional[Backbone] = None, learning_rate: float = 0.001) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone if backbone is not None else Backbone()

    def forward(self, x):
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("valid_loss", F.cross_entropy(self(x), y), on_step=True)

    def on_train_start(self) -> None:
        record("resumed", global_step=self.trainer.global_step)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)  # synthetic images in place of MNIST
        images, labels = torch.rand(200, 1, 28, 28, generator=generator), torch.randint(0, 10, (200,), generator=generator)
        self.train_set, self.val_set = random_split(TensorDataset(images, labels), [160, 40],
                                                    generator=torch.Generator().manual_seed(42))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


class ResumingCLI(LightningCLI):
    """The documented lines: ``fit`` resumes from the newest checkpoint of the trainer's ``ModelCheckpoint``
    (every rank; the default folder included, across the logger's versions)."""

    def before_fit(self) -> None:
        fit = self.config_init.fit
        fit.ckpt_path = fit.ckpt_path or latest_checkpoint(self.trainer)
        record("asked", path=fit.ckpt_path)


def cli_main() -> None:
    cli = ResumingCLI(LitClassifier, MyDataModule, seed_everything_default=1234,
                      save_config_kwargs={"overwrite": True})
    if RANK == 0:
        torch.save(cli.model.state_dict(), OUT / "weights.pt")
    record("done", global_step=cli.trainer.global_step)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"attempt{ATTEMPT}.0_rank{RANK}.json").write_text(json.dumps({"pid": os.getpgid(0), "own_pid": os.getpid()}))
    sys.argv[1:] = COMMAND  # as typed after the script's name
    cli_main()
