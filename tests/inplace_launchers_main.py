"""A seeded 2-rank training wrapped in ``recover_in_place``, under the launchers other than a plain
``init_process_group`` under torchrun: Ignite's ``idist.Parallel`` and Lightning's ``ddp``.

    python inplace_launchers_main.py parallel OUTDIR        idist.Parallel(nproc_per_node=2) spawns the ranks;
                                                             p.run(recover_in_place(training, ...), out)
    torchrun ... inplace_launchers_main.py parallel OUTDIR  the same with idist.Parallel(backend) under torchrun
                                                             (or any launcher that sets RANK): the group exists
                                                             when recover_in_place is called
    torchrun ... inplace_launchers_main.py parallel-inside OUTDIR
                                                             recover_in_place(main), where main opens
                                                             idist.Parallel(backend) itself (its __exit__
                                                             destroys the group on the failure path)
    python inplace_launchers_main.py parallel-inside OUTDIR unsupported: recover_in_place around
                                                             idist.Parallel(nproc_per_node=2), in the parent
    python inplace_launchers_main.py ddp OUTDIR             Lightning Trainer(strategy="ddp", devices=2): rank 0
                                                             starts rank 1 (this script again)
    python inplace_launchers_main.py ddp_spawn OUTDIR       unsupported: Trainer(strategy="ddp_spawn")

Ignite: ``Checkpoint`` + ``SafeDiskSaver`` every ``EVERY`` iterations, resumed with
``Checkpoint.load_objects``; Lightning: ``ModelCheckpoint(every_n_train_steps=EVERY)``, resumed with
``trainer.fit(..., ckpt_path=latest_checkpoint(dir))``. Both with ``FaultTolerance``, a
``DistributedSampler(shuffle=True, seed=0)`` over 200 samples, batch 4 per rank (25 iterations an
epoch), ``EPOCHS`` epochs (2), ``WORKERS`` DataLoader workers (0). Faults come from ``FTH_INJECT``
(first attempt only, the default).

``INPLACE=<max_restarts>`` (default 2; empty: no ``recover_in_place``). Each attempt of each rank
writes ``OUTDIR/attempt<A>_rank<R>.json`` at its start (pid, which checkpoint it resumed from, at
which iteration, what ``idist`` says of the group) and updates it at its end; it appends the sample
indices of every batch it trains to ``OUTDIR/batches<R>.jsonl``; rank 0 writes ``OUTDIR/weights.pt``
at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from regression_data import Regression  # noqa: E402 - beside this program

from fault_tolerant_handlers import RestartableDataLoader, latest_checkpoint, recover_in_place, recovery_attempt  # noqa: E402

SHAPE, OUT = sys.argv[1], Path(sys.argv[2])
INPLACE = os.environ.get("INPLACE", "2")
EVERY = int(os.environ.get("EVERY", "10"))
EPOCHS = int(os.environ.get("EPOCHS", "2"))
WORKERS = int(os.environ.get("WORKERS", "0"))
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("PG_TIMEOUT_SEC", "20")))
CKPT = OUT / "ckpt"


def make_loader(rank: int, world: int) -> RestartableDataLoader:
    data = Regression(200)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    return RestartableDataLoader(data, batch_size=4, sampler=sampler, num_workers=WORKERS, max_restarts=3)


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + recovery_attempt()


def note(rank: int, info: dict) -> None:
    info.update(attempt=attempt(), rank=rank, pid=os.getpid(), t=time.time())
    (OUT / f"attempt{attempt()}_rank{rank}.json").write_text(json.dumps(info))


def update(rank: int, **info) -> None:
    path = OUT / f"attempt{attempt()}_rank{rank}.json"
    record = json.loads(path.read_text())
    record.update(info)
    path.write_text(json.dumps(record))


class Trace:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.file = open(OUT / f"batches{rank}.jsonl", "a")
        self.first = None

    def __call__(self, step: int, idx: torch.Tensor) -> None:
        if self.first is None:
            self.first = step
            update(self.rank, first_step=step)
        self.file.write(json.dumps({"attempt": attempt(), "step": step, "idx": idx.tolist()}) + "\n")
        self.file.flush()


def idist_state() -> dict:
    """What ``ignite.distributed`` says of the group (its cached computation model) and what torch says."""
    import ignite.distributed as idist
    from ignite.distributed import utils as idist_utils

    return {"backend": idist.backend(), "rank": idist.get_rank(), "world_size": idist.get_world_size(),
            "local_rank": idist.get_local_rank(), "nproc_per_node": idist.get_nproc_per_node(),
            "model": type(idist_utils._model).__name__, "model_id": id(idist_utils._model),
            "dist_rank": dist.get_rank(), "dist_world_size": dist.get_world_size()}


def train_ignite(local_rank: int, out: str) -> None:
    """One attempt: everything built here, resumed from the newest checkpoint (the group is idist's)."""
    import ignite.distributed as idist
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint
    from torch.nn.parallel import DistributedDataParallel

    from fault_tolerant_handlers.ignite import FaultTolerance, SafeDiskSaver

    rank, world = idist.get_rank(), idist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = make_loader(rank, world)
    trace = Trace(rank)

    def step(engine, batch):
        idx, x, y = batch
        trace(engine.state.iteration, idx)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    trainer = Engine(step)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: loader.sampler.set_epoch(e.state.epoch - 1))
    FaultTolerance().attach(trainer)
    to_save = {"model": model, "optimizer": opt, "trainer": trainer, "loader": loader}
    saver = Checkpoint(to_save, SafeDiskSaver(str(CKPT), require_empty=False), n_saved=2,
                       global_step_transform=lambda e, _: e.state.iteration)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=EVERY), saver)
    path = latest_checkpoint(CKPT)
    if path:
        Checkpoint.load_objects(to_load=to_save, checkpoint=path)
    note(rank, {"resumed_from": path, "start_iteration": trainer.state.iteration, "idist": idist_state()})
    trainer.run(loader, max_epochs=EPOCHS)
    ranks = idist.all_reduce(torch.tensor([float(rank)]))  # idist's collectives over this attempt's group
    update(rank, done=True, iteration=trainer.state.iteration, all_reduced_ranks=ranks.item(), idist_end=idist_state())
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, OUT / "weights.pt")


def ddp_rank() -> int:
    """The rank under Lightning's ``ddp`` on one host: rank 1 is started with LOCAL_RANK=1."""
    return int(os.environ.get("LOCAL_RANK", "0"))


TRACE: Trace | None = None
if SHAPE in ("ddp", "ddp_spawn"):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):  # at module level: ddp_spawn pickles the model
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            if TRACE is not None:
                TRACE(self.global_step + 1, idx)
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)


def train_lightning() -> None:
    """One attempt: a new Trainer each time, resumed from the newest checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fault_tolerant_handlers.lightning import FaultTolerance

    global TRACE
    rank = ddp_rank()
    TRACE = Trace(rank)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=SHAPE, max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[FaultTolerance(),
                   ModelCheckpoint(dirpath=str(CKPT), every_n_train_steps=EVERY, save_top_k=2, monitor="step",
                                   mode="max", save_last=True)],
    )
    path = latest_checkpoint(CKPT)
    from fault_tolerant_handlers.data import snapshots

    # the step it resumes at (from the live state or the copy in memory without taking it: fit() takes it)
    kept = snapshots.newest(path) if path else None
    start = (kept or torch.load(path, map_location="cpu", weights_only=False))["global_step"] if path else 0
    note(rank, {"resumed_from": path, "start_iteration": start})
    model = Module()
    trainer.fit(model, make_loader(rank, 2), ckpt_path=path)
    update(rank, done=True, iteration=int(trainer.global_step), global_rank=trainer.global_rank,
           children_started=len(getattr(trainer.strategy.launcher, "procs", [])))
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.layer.state_dict().items()}, OUT / "weights.pt")


def maybe_recover(fn):
    return recover_in_place(fn, max_restarts=int(INPLACE)) if INPLACE else fn


def main_parallel_inside(out: str) -> None:
    """Shape (b): the function recovered in place opens ``idist.Parallel`` itself."""
    import ignite.distributed as idist

    spawn = {} if "RANK" in os.environ else {"nproc_per_node": 2}  # spawn: unsupported (a clear error)
    with idist.Parallel(backend="gloo", timeout=PG_TIMEOUT, **spawn) as parallel:
        parallel.run(train_ignite, out)


def main() -> None:
    CKPT.mkdir(parents=True, exist_ok=True)
    if SHAPE == "parallel":  # shape (a): the group exists when recover_in_place is called
        import ignite.distributed as idist

        spawn = {} if "RANK" in os.environ else {"nproc_per_node": 2}
        with idist.Parallel(backend="gloo", timeout=PG_TIMEOUT, **spawn) as parallel:
            parallel.run(maybe_recover(train_ignite), str(OUT))
    elif SHAPE == "parallel-inside":
        maybe_recover(main_parallel_inside)(str(OUT))
    elif SHAPE in ("ddp", "ddp_spawn"):  # ddp_spawn: unsupported
        maybe_recover(train_lightning)()
    else:
        raise SystemExit(f"unknown shape {SHAPE!r}: parallel, parallel-inside, ddp or ddp_spawn")


if __name__ == "__main__":
    main()
