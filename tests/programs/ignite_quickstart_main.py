"""A distributed Ignite training written from Ignite's quick start, resumable, with no line of the
library's but ``FaultTolerance().attach``, ``latest_checkpoint`` and the loader: started by torchrun.

``torchrun --standalone --nproc-per-node 4 ignite_quickstart_main.py OUTDIR``

``idist.auto_model`` (a ``DistributedDataParallel`` under torchrun), ``create_supervised_trainer``, a
``Checkpoint`` every ``EVERY`` iterations whose ``to_save`` holds the DDP as ``auto_model`` returned
it (``MODULE=1``: its ``.module``, the model as built), resumed with ``Checkpoint.load_objects(to_load=
to_save, checkpoint=path)``; no ``DDPBucketLayout``. Seeded; ``DistributedSampler(seed=0)`` over 50
samples per rank (13 iterations at any world size), batch 4 per rank, one epoch. ``INPLACE=<n>``: wrapped in ``recover_in_place(max_restarts=n)``.
Faults from ``FTH_INJECT`` (first attempt only).

Each attempt of each rank writes ``OUTDIR/attempt<A>_rank<R>.json`` (pid, the checkpoint it resumed
from, the iteration it resumed at); rank 0 writes ``OUTDIR/weights.pt`` at the end.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Events, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from fault_tolerant_handlers import RestartableDataLoader, latest_checkpoint, recover_in_place, recovery_attempt
from fault_tolerant_handlers.ignite import FaultTolerance

OUT = Path(sys.argv[1])
CKPT = OUT / "ckpt"
EVERY = int(os.environ.get("EVERY", "5"))
MODULE = os.environ.get("MODULE", "0") == "1"
INPLACE = os.environ.get("INPLACE", "")


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + recovery_attempt()


def training() -> None:
    dist.init_process_group("gloo")
    rank, world = idist.get_rank(), idist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50 * world, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True) * 0.5 + 1.0)
    loader = RestartableDataLoader(data, batch_size=4, sampler=DistributedSampler(data, world, rank, seed=0))
    model = idist.auto_model(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5))
    trainer = create_supervised_trainer(model, optimizer, nn.MSELoss())
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: loader.sampler.set_epoch(e.state.epoch - 1))
    FaultTolerance().attach(trainer)
    to_save = {"trainer": trainer, "model": model.module if MODULE else model, "optimizer": optimizer,
               "loader": loader}
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=EVERY),
                              Checkpoint(to_save, DiskSaver(str(CKPT), require_empty=False), n_saved=2,
                                         global_step_transform=lambda e, _: e.state.iteration))
    path = latest_checkpoint(CKPT)
    if path:
        Checkpoint.load_objects(to_load=to_save, checkpoint=path)
    (OUT / f"attempt{attempt()}_rank{rank}.json").write_text(json.dumps(
        {"pid": os.getpid(), "resumed_from": path, "start_iteration": trainer.state.iteration,
         "ddp": type(model).__name__}))
    trainer.run(loader, max_epochs=1)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, OUT / "weights.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    CKPT.mkdir(parents=True, exist_ok=True)
    run = recover_in_place(training, max_restarts=int(INPLACE)) if INPLACE else training
    run()
