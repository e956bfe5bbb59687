"""Lightning DDP on 2 CPU ranks that survives a failure: relaunched and resumed, or recovered in place.

Relaunch and resume: torchrun starts the failed job again, and ``trainer.fit`` goes on from the newest
checkpoint at the exact next batch::

    FTH_INJECT=raise@rank=1,iteration=14 torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/resume_lightning.py

Recover in place (``--in-place``): the same processes call ``train`` again (Lightning re-forms the
process group inside ``fit``), without a relaunch, from the ranks' live state at the last completed step::

    FTH_INJECT=raise@rank=1,iteration=14 torchrun --standalone --nproc-per-node 2 examples/resume_lightning.py --in-place

Rank 1 raises at global step 14 (``FTH_INJECT``'s iteration is ``trainer.global_step + 1``; it fires
in the first attempt only); every rank stops together, and the next attempt resumes from the
checkpoint of step 10 (in place: from ``live-state-step=13.pt``, the live state of step 13, nothing
trained twice) and trains to step 60. Without ``FTH_INJECT`` nothing fails. Checkpoints go to
``--dir`` (``ckpts/lightning``): remove it to start from scratch.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler, TensorDataset

from fault_tolerant_handlers import RestartableDataLoader, latest_checkpoint, recover_in_place, recovery_attempt
from fault_tolerant_handlers.lightning import FaultTolerance


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def train(ckpt_dir: str) -> int:
    """One attempt: everything is built here, so that a recovery in place can call it again."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp",
                        max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False,  # the loader below has its own DistributedSampler
                        callbacks=[FaultTolerance(), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=10)])
    rank, world = trainer.global_rank, trainer.world_size
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = RestartableDataLoader(data, batch_size=4, sampler=sampler, num_workers=1)  # saved in the checkpoint
    path = latest_checkpoint(ckpt_dir)  # the newest complete one, the same on every rank; None at first
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + recovery_attempt()
    print(f"[rank {rank}] attempt {attempt}: {f'resuming from {os.path.basename(path)}' if path else 'started'}",
          flush=True)
    trainer.fit(Model(), loader, ckpt_path=path)
    print(f"[rank {rank}] finished at step {trainer.global_step}", flush=True)
    return trainer.global_step


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-place", action="store_true", help="recover in place instead of being relaunched")
    parser.add_argument("--dir", default="ckpts/lightning", help="checkpoint directory (default: ckpts/lightning)")
    args = parser.parse_args()
    run = recover_in_place(train, max_restarts=2) if args.in_place else train
    run(args.dir)
