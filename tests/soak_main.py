"""A healthy training with the library on many ranks, no fault: nothing may be declared.

    python -m torch.distributed.run --standalone --nproc-per-node 8 soak_main.py ignite OUTDIR
    SOAK_RANKS=8 python soak_main.py lightning OUTDIR      (Lightning's ``ddp`` starts the other ranks)

Ignite: ``init_process_group`` (gloo), a DDP model, ``FaultTolerance`` attached, 2 epochs of 30
iterations over a ``DistributedSampler``. Lightning: ``Trainer(strategy="ddp", devices=SOAK_RANKS)``
on CPU with the callback, 2 epochs of 30 steps. Each rank writes ``OUTDIR/rank<R>.json``: the
iterations it finished, or what its run raised (type and first line). The process groups' timeout
is ``SOAK_PG_TIMEOUT`` seconds (default 60): a rank stalled for a minute must fail the run, not pass
unseen under a longer timeout. Each rank also records when it finished its first iteration
(``first``, ``time.time()``) and ``launched`` (``SOAK_LAUNCHED``, set by the harness), so that the time
from launch to the first trained iteration can be compared with and without the library
(``SOAK_LIBRARY=0``: the same job, stock).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

LIBRARY = os.environ.get("SOAK_LIBRARY", "1") != "0"
if LIBRARY:
    import fault_tolerant_handlers  # noqa: F401 - before init_process_group, as documented

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
EPOCHS, ITERS, BATCH = 2, 30, 4
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("SOAK_PG_TIMEOUT", "60")))
FIRST: dict = {}


def first_done() -> None:
    FIRST.setdefault("first", time.time())


def data(world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(world * ITERS * BATCH, 16, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def note(rank: int, **info) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), "t": time.time(),
                                                      **FIRST, **info}))


def run_ignite() -> None:
    import torch.distributed as dist
    from ignite.engine import Engine
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    net = DistributedDataParallel(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    dataset = data(world)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, world, rank, seed=0))

    def step(engine, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first_done()
        return loss.item()

    trainer = Engine(step)
    if LIBRARY:
        from fault_tolerant_handlers.ignite import FaultTolerance
        FaultTolerance().attach(trainer)

    try:
        trainer.run(loader, max_epochs=EPOCHS)
    except BaseException as exc:  # noqa: BLE001 - recorded for the caller, then raised
        note(rank, raised=type(exc).__name__, message=(str(exc).splitlines() or [""])[0][:500])
        raise
    note(rank, finished=trainer.state.iteration)
    dist.destroy_process_group()


def run_lightning() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    world = int(os.environ.get("SOAK_RANKS", "8"))

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, *args) -> None:
            first_done()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(data(world), batch_size=BATCH)

    if LIBRARY:
        from fault_tolerant_handlers.lightning import FaultTolerance
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(timeout=PG_TIMEOUT),
                         max_epochs=EPOCHS, callbacks=[FaultTolerance()] if LIBRARY else [], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)

    try:
        trainer.fit(Net())
    except BaseException as exc:  # noqa: BLE001 - recorded for the caller, then raised
        note(trainer.global_rank, raised=type(exc).__name__, message=(str(exc).splitlines() or [""])[0][:500])
        raise
    note(trainer.global_rank, finished=trainer.global_step)


if __name__ == "__main__":
    {"ignite": run_ignite, "lightning": run_lightning}[FRAMEWORK]()
