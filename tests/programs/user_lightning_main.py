"""A Lightning training script as users write it (written for these tests, data synthetic): a
``LightningModule`` that logs its loss every step, the ``Trainer``'s default logger (a ``CSVLogger`` in
``lightning_logs/version_N`` here, where tensorboard is not installed) and default ``ModelCheckpoint``,
with the documented lines added (``FaultTolerance()``, ``recover_in_place``). The script loads no
checkpoint itself (``fit(ckpt_path=None)``). Run under torchrun with 2 gloo ranks:

    torchrun --nproc-per-node 2 user_lightning_main.py OUTDIR

Each rank writes ``attempt<a>_rank<r>.json`` (pid, the global step its training started at and ended
at, the logger's folder). ``SPARES=1`` (with a third process launched): one spare rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from fault_tolerant_handlers import recover_in_place, recovery_attempt
from fault_tolerant_handlers.lightning import FaultTolerance

OUT = Path(sys.argv[1])


def note(rank: int, **info) -> None:
    path = OUT / f"attempt{recovery_attempt()}_rank{rank}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, "pid": os.getpid(), **info}))


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_start(self) -> None:
        note(self.global_rank, start_step=int(self.trainer.global_step), log_dir=self.trainer.log_dir)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    torch.manual_seed(7)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, log_every_n_steps=1,
                        default_root_dir=str(OUT), enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[FaultTolerance()])
    trainer.fit(Regressor(), loader)
    note(trainer.global_rank, done=True, step=int(trainer.global_step))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    recover_in_place(main, max_restarts=2, spares=int(os.environ.get("SPARES", "0")))()
