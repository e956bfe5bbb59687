"""A ``LightningCLI`` script with a YAML config (``user_lightning_cli.yaml``), shaped like Lightning's
``examples/pytorch/basics/autoencoder.py`` (written for these tests, data synthetic): a ``LightningModule``
and a ``LightningDataModule`` (``RestartableDataLoader`` with a worker, shuffled, as docs/recovering.md
says), ``seed_everything`` from the config, ``trainer.callbacks`` holding ``FaultTolerance``, a
``ModelCheckpoint`` every 4 steps with ``last.ckpt``, and a best-model ``ModelCheckpoint`` with
``save_weights_only`` in the same default folder. The documented lines: the CLI's ``before_fit`` gives
``fit`` ``latest_checkpoint(self.trainer)``; ``in-place`` wraps the CLI's making in ``recover_in_place``.

    torchrun --nproc-per-node 2 [--max-restarts 1] user_lightning_cli_yaml_main.py {relaunch,in-place} OUTDIR

Each rank records JSON lines in ``OUTDIR/rank<R>.jsonl`` (``asked``: what ``latest_checkpoint`` gave;
``resumed``: the global step training started at and the logger's folder; ``done``); rank 0 saves its
final weights in ``OUTDIR/weights.pt``; ``OUTDIR/attempt<A>.<I>_rank<R>.json`` names the process (the
test's cleanup).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

from fault_tolerant_handlers import RestartableDataLoader, latest_checkpoint, recover_in_place, recovery_attempt

MODE, OUT = (sys.argv[1], Path(sys.argv[2])) if __name__ == "__main__" else ("", Path("."))
RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
CONFIG = Path(__file__).with_name("user_lightning_cli.yaml")


def record(event: str, **fields) -> None:
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "rank": RANK, "attempt": ATTEMPT, "in_place": recovery_attempt(),
                            "t": time.time(), **fields}, default=str) + "\n")


class LitRegressor(LightningModule):
    def __init__(self, hidden_dim: int = 32, learning_rate: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden_dim), torch.nn.ReLU(), torch.nn.Linear(hidden_dim, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_start(self) -> None:
        record("resumed", global_step=self.trainer.global_step, log_dir=self.trainer.log_dir)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 7, gamma=0.5)}


class DataModule(LightningDataModule):
    def __init__(self, batch_size: int = 8, num_workers: int = 1) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(200, 16, generator=g)
        data = TensorDataset(x, x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(200, 1, generator=g))
        self.train_set, self.val_set = random_split(data, [160, 40], generator=torch.Generator().manual_seed(42))

    def train_dataloader(self):
        return RestartableDataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                                     num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


class CLI(LightningCLI):
    def before_fit(self) -> None:
        fit = self.config_init.fit
        fit.ckpt_path = fit.ckpt_path or latest_checkpoint(self.trainer)
        record("asked", path=fit.ckpt_path)

    def after_fit(self) -> None:
        if RANK == 0:
            torch.save(self.model.state_dict(), OUT / "weights.pt")
        record("done", global_step=self.trainer.global_step)


def cli_main() -> None:
    (OUT / f"attempt{ATTEMPT}.{recovery_attempt()}_rank{RANK}.json").write_text(
        json.dumps({"pid": os.getpgid(0), "own_pid": os.getpid()}))
    CLI(LitRegressor, DataModule, save_config_kwargs={"overwrite": True},
        args=["fit", f"--config={CONFIG}", f"--trainer.default_root_dir={OUT}"])


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    (recover_in_place(cli_main, max_restarts=1) if MODE == "in-place" else cli_main)()
