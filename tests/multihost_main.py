"""One rank of a multi-host run: a real DDP training that lasts until something ends it.

Started by ``torchrun`` inside a simulated host (``tests/hosts.py``)::

    python -m torch.distributed.run --nnodes 2 ... multihost_main.py <outdir>

Every rank appends JSON events with wall-clock times to ``<outdir>/rank<r>.jsonl``: ``start``
(host name, pid in its host), ``ready`` (iteration ``READY_ITER`` reached: the rig injects host
faults after every rank is ready), ``fault`` (an ``FTH_INJECT`` injection firing on this rank),
``peer_failure`` and ``watchdog_exit`` (the library's watchdog logged a detection / its reported
exit), ``run_raised`` (what ``run``/``fit`` raised, with ``PeerFailedError``'s fields),
``run_returned`` and ``exit``.

Environment:
    FRAMEWORK    ignite (default) | lightning
    USE_FT       1 (default): the library's ``FaultTolerance`` with default settings; 0: stock
    FTH_INJECT   raise/kill/hang one rank (the adapters read it; stock runs fire it here at the same
                 point, the start of the iteration)
    READY_ITER   iteration at which ``ready`` is recorded (default 10)
    STEP_SEC     extra time per step, seconds (default 0.02)
    MAX_ITERS    iterations before the run ends by itself (default 100000: the rig ends it)
    FTH_TEST_PG_TIMEOUT  process-group timeout, seconds (default 60)
    GIL_HOLD     ``rank,iteration,seconds``: that rank's main thread holds the GIL for that long in
                 one C call at the start of that iteration's step (records ``gil_start``/``gil_end``)
    LINGER       seconds a rank whose own injected fault raised stays alive (default 8), so that a
                 peer is not released by its exit
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

FRAMEWORK = os.environ.get("FRAMEWORK", "ignite")
USE_FT = os.environ.get("USE_FT", "1") == "1"
READY_ITER = int(os.environ.get("READY_ITER", "10"))
GIL_HOLD = tuple(int(v) for v in os.environ["GIL_HOLD"].split(",")) if os.environ.get("GIL_HOLD") else ()
READY_SEEN = False


def _settled() -> bool:
    """With the library: every rank's liveness process has beaten twice (store connections on a
    simulated host can take seconds to come up); a fault before that tests the start-up."""
    if not USE_FT:
        return True
    from fault_tolerant_handlers.core.session import get_session

    session = get_session()
    conn = session.connection("ready-check", timedelta(seconds=5))
    try:
        return all(int(conn.call("add", f"hb/{r}", 0)) >= 2 for r in session.ranks)
    except Exception:  # noqa: BLE001
        return False
    finally:
        conn.close()


def _ready(iteration: int) -> None:
    global READY_SEEN
    READY_SEEN = True
    record("ready", iteration=iteration)
STEP_SEC = float(os.environ.get("STEP_SEC", "0.02"))
MAX_ITERS = int(os.environ.get("MAX_ITERS", "100000"))
LINGER = float(os.environ.get("LINGER", "8"))
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("FTH_TEST_PG_TIMEOUT", "60")))
RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[1])
N = 256
BATCH = 4


def record(event: str, **fields) -> None:
    fields.update(event=event, rank=RANK, t=time.time())
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


class RecordInjected(logging.StreamHandler):
    """Record an ``FTH_INJECT`` injection firing on this rank as the ``fault`` event, the
    watchdog's detection as ``peer_failure`` and its reported exit as ``watchdog_exit`` (the main
    thread records nothing then); print the library's warnings and errors to stderr, as logging's
    last-resort handler would without it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)

    def emit(self, rec: logging.LogRecord) -> None:
        msg = rec.getMessage()
        if "FTH_INJECT" in msg and "injecting" in msg:
            record("fault", message=msg)
        elif "] peer failure: " in msg:
            record("peer_failure", message=msg)
        elif "ending this process with exit code" in msg:
            record("watchdog_exit", message=msg)
        super().emit(rec)


class Samples(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 8, generator=g)
        self.y = torch.randn(N, 1, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def ended(exc: BaseException, injected_here: bool) -> None:
    fields = dict(raised=type(exc).__name__, message=str(exc)[:4000])
    for attr in ("failed_rank", "host", "pid", "exc_type", "exc_message", "where", "others"):
        if hasattr(exc, attr):
            fields[attr] = getattr(exc, attr)
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        fields["cause"] = f"{type(cause).__name__}: {str(cause)[:2000]}"
    record("run_raised", **fields)
    if injected_here:
        time.sleep(LINGER)
    record("exit")
    raise SystemExit(1)  # as the uncaught exception of a real training script: its agent sees a failure


def _injector():
    if USE_FT or not os.environ.get("FTH_INJECT", "").strip():
        return None  # the adapter fires it itself
    from fault_tolerant_handlers.inject import Injector

    return Injector.from_env()


def _injects_here() -> bool:
    from fault_tolerant_handlers.inject import parse

    return any(i.rank == RANK for i in parse(os.environ.get("FTH_INJECT", "")))


def run_ignite() -> None:
    import ignite.distributed as idist
    from ignite.engine import Engine, Events

    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    torch.manual_seed(0)
    model = idist.auto_model(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = idist.auto_dataloader(Samples(), batch_size=BATCH * idist.get_world_size(), shuffle=False)

    def step(engine, batch):
        x, y = batch
        if GIL_HOLD and (RANK, engine.state.iteration) == GIL_HOLD[:2]:
            import ctypes

            record("gil_start")
            ctypes.PyDLL(None).sleep(GIL_HOLD[2])  # a C call that keeps the GIL: no thread of this process runs
            record("gil_end")
        time.sleep(STEP_SEC)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    injector = _injector()

    @trainer.on(Events.ITERATION_STARTED)
    def _started(e):
        if e.state.iteration >= READY_ITER and not READY_SEEN and _settled():
            _ready(e.state.iteration)
        if injector is not None:
            injector.maybe_fire(RANK, e.state.iteration, e.state.epoch, e.state.dataloader)

    @trainer.on(Events.ITERATION_COMPLETED(once=MAX_ITERS))
    def _enough(e):
        e.terminate()

    if USE_FT:
        from fault_tolerant_handlers.ignite import FaultTolerance

        FaultTolerance().attach(trainer)
    try:
        trainer.run(loader, max_epochs=10**6)
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        ended(exc, _injects_here())
        return
    record("run_returned", iteration=trainer.state.iteration)
    record("exit")


def run_lightning() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    injector = _injector()

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(STEP_SEC)
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Samples(), batch_size=BATCH)

    class Recorder(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            iteration = trainer.global_step + 1
            if iteration >= READY_ITER and not READY_SEEN and _settled():
                _ready(iteration)
            if injector is not None:
                injector.maybe_fire(RANK, iteration, trainer.current_epoch)

    callbacks: list = [Recorder()]
    if USE_FT:
        from fault_tolerant_handlers.lightning import FaultTolerance

        callbacks.append(FaultTolerance())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=DDPStrategy(timeout=PG_TIMEOUT),
        max_steps=MAX_ITERS,
        max_epochs=-1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(OUT / f"lightning-rank{RANK}"),
    )
    try:
        trainer.fit(Model())
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        ended(exc, _injects_here())
        return
    record("run_returned", iteration=trainer.global_step)
    record("exit")


def main() -> None:
    record("start", host=socket.gethostname(), pid=os.getpid(), framework=FRAMEWORK, use_ft=USE_FT)
    logging.getLogger("fault_tolerant_handlers").addHandler(RecordInjected())
    {"ignite": run_ignite, "lightning": run_lightning}[FRAMEWORK]()


if __name__ == "__main__":
    main()
