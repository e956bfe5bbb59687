"""A healthy training with the library on many ranks, no fault: nothing may be declared.

    python -m torch.distributed.run --standalone --nproc-per-node 8 soak_main.py ignite OUTDIR
    SOAK_RANKS=8 python soak_main.py lightning OUTDIR      (Lightning's ``ddp`` starts the other ranks)

Ignite: ``init_process_group`` (gloo), a DDP model, ``FaultTolerance`` attached, 2 epochs of 30
iterations over a ``DistributedSampler``. Lightning: ``Trainer(strategy="ddp", devices=SOAK_RANKS)``
on CPU with the callback, 2 epochs of 30 steps. Each rank writes ``OUTDIR/rank<R>.json``: the
iterations it finished, or what its run raised (type and first line), and when it finished each
iteration (``times``, ``time.time()``; ``first``, the first), so that the time from launch to the first
trained iteration can be compared with and without the library, and near the end its TCP
connections to the store (``store_conns``, its own and its helper processes') and the library's CPU
since the first iteration (``lib_cpu``, a fraction of a core).

Settings (environment):

* ``SOAK_PG_TIMEOUT`` (60): the process groups' timeout in seconds. A rank stalled for a minute must
  fail the run, not pass unseen under a longer timeout.
* ``SOAK_LIBRARY=0``: the same job, stock (no import of the library, no handler).
* ``SOAK_HANG_TIMEOUT`` (seconds, or ``auto``): the handler's ``hang_timeout`` (off by default).
* ``SOAK_OTHER_WORK_EVERY=<n>`` (Lightning): every ``n`` steps a ``ModelCheckpoint`` writes a checkpoint
  to ``OUTDIR/checkpoints`` (kept) and a validation runs (``val_check_interval``): work between steps
  that ``hang_timeout="auto"`` judges by its own kind's deadline, not a step's.
* ``SOAK_INPLACE=<max_restarts>``: the run wrapped in ``recover_in_place``; a healthy run recovers
  nothing (each rank records ``attempt``, the recovery attempt it finished in).
* ``SOAK_STEP_SLEEP`` (0): seconds each step sleeps (a longer steady phase).
* ``SOAK_SLOW_CONNECT`` (seconds): every store connection the library makes takes this long to
  connect (a store server busy starting many ranks); each rank records ``run_at``, when it called
  ``run``/``fit``, to compare with ``first``.
* ``SOAK_SLOW_START=<rank>:<seconds>``: that rank's first step takes that long (a compile, a cold
  cache): a slow start, not a hang.
* ``SOAK_HANG_AT=<rank>:<step>:<seconds>``: that rank sleeps that long in that step (1-based), after the start.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from overhead import cpu_of, library_tasks  # noqa: E402 - the bench's reading of the library's CPU

LIBRARY = os.environ.get("SOAK_LIBRARY", "1") != "0"
#: Seconds each step sleeps (a longer steady phase, for the library's CPU and connections).
STEP_SLEEP = float(os.environ.get("SOAK_STEP_SLEEP", "0"))
if LIBRARY:
    import fault_tolerant_handlers  # noqa: F401 - before init_process_group, as documented

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
EPOCHS, ITERS, BATCH = 2, 30, 4
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("SOAK_PG_TIMEOUT", "60")))
_HANG = os.environ.get("SOAK_HANG_TIMEOUT")
HANG_TIMEOUT: float | str | None = _HANG if _HANG == "auto" else float(_HANG) if _HANG else None
OTHER_WORK_EVERY = int(os.environ.get("SOAK_OTHER_WORK_EVERY", "0"))
INPLACE = os.environ.get("SOAK_INPLACE")
SLOW_START = os.environ.get("SOAK_SLOW_START")
HANG_AT = os.environ.get("SOAK_HANG_AT")
if LIBRARY and os.environ.get("SOAK_SLOW_CONNECT"):
    from fault_tolerant_handlers.core import session as _session

    def _slow_probe(*args, _probe=_session.probe_store_port, _delay=float(os.environ["SOAK_SLOW_CONNECT"])):
        time.sleep(_delay)
        return _probe(*args)

    _session.probe_store_port = _slow_probe
FIRST: dict = {}


def slow_start(rank: int) -> None:
    """``SOAK_SLOW_START``: before this rank's first step; ``SOAK_HANG_AT``: in a later one."""
    if SLOW_START and "first" not in FIRST:
        who, seconds = SLOW_START.split(":")
        if int(who) == rank:
            time.sleep(float(seconds))
    if HANG_AT:
        who, step, seconds = HANG_AT.split(":")
        if int(who) == rank and FIRST.get("steps", 0) + 1 == int(step):
            time.sleep(float(seconds))


def step_done() -> None:
    """After each trained step: the time of the first; near the end, the steady phase's figures
    (while the watchdog still runs: it stops with the run)."""
    FIRST["steps"] = FIRST.get("steps", 0) + 1
    FIRST.setdefault("times", []).append(round(time.time(), 3))
    if FIRST["steps"] == EPOCHS * ITERS - 2:
        FIRST.update(steady())
    if "first" not in FIRST:
        FIRST["first"] = time.time()
        FIRST["_cpu0"] = (time.monotonic(), cpu_of(library_tasks()))
    if STEP_SLEEP:
        time.sleep(STEP_SLEEP)


def _sockets(pid: int | str) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def steady() -> dict:
    """Near the end of training: this rank's TCP connections to the store (its own and its library
    helper processes') and the library's CPU since the first iteration, as a fraction of a core."""
    port = int(os.environ.get("MASTER_PORT", "0"))
    tasks = library_tasks()
    pids = [os.getpid()] + [int(path.rsplit("/", 1)[1]) for label, path in tasks.items() if "/pid " in label]
    inodes = set().union(*(_sockets(pid) for pid in pids))
    conns = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) == port and f[9] in inodes:
                conns += 1
    out = {"store_conns": conns}
    if "_cpu0" in FIRST:
        t0, before = FIRST.pop("_cpu0")
        after = cpu_of(tasks)
        # schedstat's nanoseconds where the kernel has them (stat's clock ticks are 10 ms)
        used = sum((a[1] - before[k][1]) if k in before and a[1] is not None and before[k][1] is not None
                   else (a[1] if k not in before and a[1] is not None else a[0] - before.get(k, (0.0, None))[0])
                   for k, a in after.items())
        out["lib_cpu"] = used / max(1e-9, time.monotonic() - t0)
    return out


def data(world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(world * ITERS * BATCH, 16, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def note(rank: int, **info) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    kept = {k: v for k, v in FIRST.items() if not k.startswith("_")}
    (OUT / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), "t": time.time(),
                                                      **kept, **info}))


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
        slow_start(rank)
        x, y = batch
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_done()
        return loss.item()

    trainer = Engine(step)
    if LIBRARY:
        from fault_tolerant_handlers.ignite import FaultTolerance
        FaultTolerance(hang_timeout=HANG_TIMEOUT).attach(trainer)

    FIRST["run_at"] = time.time()
    try:
        trainer.run(loader, max_epochs=EPOCHS)
    except BaseException as exc:  # noqa: BLE001 - recorded for the caller, then raised
        note(rank, raised=type(exc).__name__, message=(str(exc).splitlines() or [""])[0][:500])
        raise
    note(rank, finished=trainer.state.iteration, **attempt_info())
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
            slow_start(self.global_rank)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, *args) -> None:
            step_done()

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(data(world), batch_size=BATCH)

        def val_dataloader(self):
            return DataLoader(data(world), batch_size=BATCH) if OTHER_WORK_EVERY else []

    if LIBRARY:
        from fault_tolerant_handlers.lightning import FaultTolerance
    callbacks: list = [FaultTolerance(hang_timeout=HANG_TIMEOUT)] if LIBRARY else []
    other: dict = dict(enable_checkpointing=False, limit_val_batches=0)
    if OTHER_WORK_EVERY:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=OUT / "checkpoints", every_n_train_steps=OTHER_WORK_EVERY,
                                         save_top_k=-1))
        other = dict(val_check_interval=OTHER_WORK_EVERY, limit_val_batches=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(timeout=PG_TIMEOUT),
                         max_epochs=EPOCHS, callbacks=callbacks, logger=False, **other,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)

    FIRST["run_at"] = time.time()
    try:
        trainer.fit(Net())
    except BaseException as exc:  # noqa: BLE001 - recorded for the caller, then raised
        note(trainer.global_rank, raised=type(exc).__name__, message=(str(exc).splitlines() or [""])[0][:500])
        raise
    note(trainer.global_rank, finished=trainer.global_step, **attempt_info())


def attempt_info() -> dict:
    if not INPLACE:
        return {}
    from fault_tolerant_handlers import recovery_attempt

    return {"attempt": recovery_attempt()}


if __name__ == "__main__":
    run = {"ignite": run_ignite, "lightning": run_lightning}[FRAMEWORK]
    if INPLACE:
        from fault_tolerant_handlers import recover_in_place

        run = recover_in_place(run, max_restarts=int(INPLACE))
    run()
