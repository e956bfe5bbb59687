"""Lightning ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``) on 2 CPU ranks
that survives a failure, with either checkpoint form of the strategy.

Relaunch and resume: torchrun starts the failed job again, and ``trainer.fit`` goes on from the newest
checkpoint at the exact next batch::

    FTH_INJECT=raise@rank=1,iteration=17 torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/lightning_model_parallel.py

Recover in place (``--in-place``): the same processes call ``train`` again (Lightning re-forms the
process group and the device mesh inside ``fit``) and carry on from live state: each rank's own
shard of the last completed step, copied at the failure into a checksummed CPU snapshot, which
``latest_checkpoint`` names and ``fit(ckpt_path=...)`` loads (no step computed twice; a rank whose
process was lost takes its shard with it: then every rank resumes from the newest checkpoint, unless
``FTH_SHARD_REPLICAS=1`` keeps each rank's shard in a partner's memory too)::

    FTH_INJECT=raise@rank=1,iteration=17 torchrun --standalone --nproc-per-node 2 examples/lightning_model_parallel.py --in-place

``--distributed`` saves distributed checkpoints (``save_distributed_checkpoint=True``: each
``epoch=0-step=10.ckpt`` is a directory of every rank's shards, found by ``latest_checkpoint`` once
complete); without it, one file with the full state (gathered to rank 0).

Rank 1 raises at global step 17 (``FTH_INJECT``'s iteration is ``trainer.global_step + 1``; it fires
in the first attempt only); every rank stops together, the next attempt resumes (relaunched: from
the checkpoint of step 10; in place: from live state at step 16) and trains to step 60, and every rank prints the SHA-256 of the final weights (gathered
with ``full_tensor()``): the same as a run without ``FTH_INJECT``. Checkpoints go to ``--dir``
(``ckpts/lightning_mp``): remove it to start from scratch.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset

from fault_tolerant_handlers import RestartableDataLoader, latest_checkpoint, recover_in_place, recovery_attempt
from fault_tolerant_handlers.lightning import FaultTolerance


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)  # every Linear, then the whole model

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def weights_sha256(module: torch.nn.Module) -> str:
    """The SHA-256 of every parameter, whole (``full_tensor()`` gathers the shards: collective)."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(param.full_tensor().detach().numpy().tobytes())
    return digest.hexdigest()


def train(ckpt_dir: str, distributed: bool) -> str:
    """One attempt: everything is built here, so that a recovery in place can call it again."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g))
    strategy = ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1,
                                     save_distributed_checkpoint=distributed)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
                        max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False,  # the loader below has its own DistributedSampler
                        callbacks=[FaultTolerance(), ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=10)])
    rank, world = trainer.global_rank, trainer.world_size
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = RestartableDataLoader(data, batch_size=4, sampler=sampler)  # saved in the checkpoint
    path = latest_checkpoint(ckpt_dir)  # a file or a directory, the newest complete one, the same on every rank
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + recovery_attempt()
    print(f"[rank {rank}] attempt {attempt}: {f'resuming from {os.path.basename(path)}' if path else 'started'}",
          flush=True)
    model = Model()
    trainer.fit(model, loader, ckpt_path=path)
    digest = weights_sha256(model)
    print(f"[rank {rank}] finished at step {trainer.global_step}, weights sha256 {digest}", flush=True)
    return digest


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-place", action="store_true", help="recover in place instead of being relaunched")
    parser.add_argument("--distributed", action="store_true", help="save distributed checkpoints (directories)")
    parser.add_argument("--dir", default="ckpts/lightning_mp", help="checkpoint directory (default: ckpts/lightning_mp)")
    args = parser.parse_args()
    run = recover_in_place(train, max_restarts=2) if args.in_place else train
    run(args.dir, args.distributed)
