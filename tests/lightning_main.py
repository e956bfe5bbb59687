"""Lightning multi-process test program: the example's model and data, a real ``Trainer`` on 2 CPU
ranks (gloo), an injected fault, and a record of what every rank raised and when.

    LAUNCH=ddp python lightning_main.py <outdir>        (Lightning's subprocess launcher starts rank 1)
    LAUNCH=ddp_spawn python lightning_main.py <outdir>  (Lightning spawns both ranks)
    python -m torch.distributed.run --nproc-per-node=2 lightning_main.py <outdir>   (LAUNCH=torchrun)

Environment:
    FAULT        raise | rank0_callback | data | validation | kill | none   (see examples/lightning_ddp.py)
                 | sigterm: rank FAULT_RANK sends itself SIGTERM (a preemption); Lightning's handler runs
                 | hang: rank FAULT_RANK sleeps in ``on_train_batch_start`` at step FAULT_STEP (set
                 ``FTH_HANG_TIMEOUT_SEC`` for the watchdog to name it)
                 | rank_first: rank FAULT_RANK (0) fails while preparing the data first: in ``setup`` inside
                 ``fault_tolerant_handlers.one_rank_first`` with USE_FT=1, in ``prepare_data`` (Lightning's
                 own rank-zero-first pattern) with USE_FT=0
                 | exc_collective: ``raise``, plus a callback whose ``on_exception`` runs a collective
    FAULT_RANK   rank that fails (default 1); FAULT_STEP global step (default 10)
    USE_FT       1: FaultTolerance in the callbacks; 0: stock Lightning
    OEC          1: OnExceptionCheckpoint in the callbacks too
    LINGER       the failing rank stays alive after its run raised until every other rank recorded
                 the end of its run, at most this many seconds (default 4), so that no other rank can
                 be released by the failing process's exit (``launch.linger``)
    FTH_TEST_TOP 1 in the process the test starts for ddp/ddp_spawn: drop the RANK/WORLD_SIZE/...
                 the harness sets, so that Lightning launches the ranks itself
    RERAISE      1: re-raise what ``fit`` raised after recording it, without waiting for the ranks this
                 process started (the process fails, as a real script's)
    WORKERS      training DataLoader workers (default 0); RESTARTABLE=1: a ``RestartableDataLoader``
    FTH_INJECT   as the adapter reads it; with USE_FT=0 a callback fires it at the same point, so that
                 stock runs get the same fault. The injection is recorded as the ``fault`` event (and
                 DataLoader restarts as ``dataloader_restart``)
    ITER_EVENTS  1: record ``iteration_completed`` events (to time a recovery)
    FAULT=hang   rank FAULT_RANK sleeps forever in ``training_step`` at FAULT_STEP (set a hang timeout, e.g.
                 FTH_HANG_TIMEOUT_SEC=auto); the ``fault`` event holds what the learned deadline knew
    SLOW         1 (with FTH_HANG_TIMEOUT_SEC=auto): long but normal work on rank 0, each 1.3 x its learned
                 step deadline of the time: the first validation batch of epoch 0 and the write of a
                 checkpoint saved by ``ModelCheckpoint(every_n_train_steps=12)`` inside step 12 (a slow
                 disk: ``CheckpointIO``); each is recorded as a ``slow`` event; 2 epochs instead of 3
    STEP_SLEEP   seconds every training step sleeps (default 0)
    SIGTERM_EVENTS 1: record ``lightning_sigterm_start`` / ``lightning_sigterm_end`` around Lightning's own
                 SIGTERM handler, and ``on_exception`` (what ``fit`` took) in a callback
    OWN_OUTPUT   1: each rank's stdout and stderr go to ``<outdir>/rank<r>.out`` from its start (with ddp,
                 from just before ``trainer.fit``)

Each rank appends JSON events to ``<outdir>/rank<r>.jsonl`` (``fault``, ``run_raised``,
``run_returned``, ``exit``); with ddp_spawn the parent writes ``parent.jsonl`` and the ranks record
through :class:`RecordingLauncher`, since their ``trainer.fit`` is not called in user code.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

if os.environ.pop("FTH_TEST_TOP", None) == "1":  # before Lightning reads the environment
    for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(_key, None)

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_ddp import BATCH, Fault, TinyData, TinyModel, make_trainer  # noqa: E402

LAUNCH = os.environ.get("LAUNCH", "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "ddp")
FAULT = os.environ.get("FAULT", "raise")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "10"))
USE_FT = os.environ.get("USE_FT", "1") == "1"
OEC = os.environ.get("OEC", "0") == "1"
LINGER = float(os.environ.get("LINGER", "4"))
PG_TIMEOUT = float(os.environ.get("FTH_TEST_PG_TIMEOUT", "20"))
RERAISE = os.environ.get("RERAISE") == "1"
WORKERS = int(os.environ.get("WORKERS", "0"))
RESTARTABLE = os.environ.get("RESTARTABLE") == "1"
ITER_EVENTS = os.environ.get("ITER_EVENTS") == "1"
INJECT = os.environ.get("FTH_INJECT", "").strip()
SLOW = os.environ.get("SLOW") == "1"
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))


def record(outdir: str, name: str, event: str, **fields) -> None:
    fields.update(event=event, t=time.time(), pid=os.getpid())
    with open(Path(outdir) / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")


def record_fault(outdir: str, rank: int, exc: BaseException) -> None:
    record(outdir, f"rank{rank}", "fault", exc_type=type(exc).__name__, message=str(exc))
    raise exc


def record_raised(outdir: str, name: str, exc: BaseException) -> None:
    fields = dict(raised=type(exc).__name__, message=str(exc)[:4000], tail=str(exc)[-2000:])
    for attr in ("failed_rank", "exc_type", "exc_message", "where", "step", "epoch", "remote_traceback"):
        if hasattr(exc, attr):
            fields[attr] = getattr(exc, attr)
    record(outdir, name, "run_raised", **fields)


class RecordInjected(logging.StreamHandler):
    """With FTH_INJECT: record the injected fault and DataLoader restarts as events. It still prints
    WARNING and above to stderr, as logging's last-resort handler would without it."""

    def __init__(self, outdir: str, name: str) -> None:
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)
        self.outdir, self.name = outdir, name

    def emit(self, rec: logging.LogRecord) -> None:
        msg = rec.getMessage()
        if "FTH_INJECT" in msg and "injecting" in msg:
            record(self.outdir, self.name, "fault", exc_type="injected", message=msg)
        elif "restarting workers" in msg:
            record(self.outdir, self.name, "dataloader_restart", message=msg)
        super().emit(rec)


def record_injections(outdir: str, name: str) -> None:
    if INJECT:
        logging.getLogger("fault_tolerant_handlers").addHandler(RecordInjected(outdir, name))


class BenchData(TinyData):
    """``TinyData`` with a rank-first data preparation that fails (FAULT=rank_first) and DataLoader workers."""

    def __init__(self, fault, outdir: str) -> None:
        super().__init__(None if fault is not None and fault.kind == "rank_first" else fault)
        self.first_fault = fault if fault is not None and fault.kind == "rank_first" else None
        self.outdir = outdir

    def _download(self) -> None:
        record_fault(self.outdir, self.first_fault.rank, OSError("mirror unreachable: https://example.invalid/data.tar.gz"))

    def prepare_data(self) -> None:  # Lightning runs it on local rank 0 only, then a barrier
        if self.first_fault is not None and not USE_FT:
            self._download()

    def setup(self, stage: str) -> None:
        if self.first_fault is not None and USE_FT:
            from fault_tolerant_handlers import one_rank_first

            with one_rank_first(rank=self.first_fault.rank):
                if self.trainer.global_rank == self.first_fault.rank:
                    self._download()
        super().setup(stage)

    def train_dataloader(self) -> DataLoader:
        if not WORKERS:
            return super().train_dataloader()
        if RESTARTABLE:
            from fault_tolerant_handlers import RestartableDataLoader

            return RestartableDataLoader(self.train, batch_size=BATCH, shuffle=False, num_workers=WORKERS)
        return DataLoader(self.train, batch_size=BATCH, shuffle=False, num_workers=WORKERS)


class SyncOnException(pl.Callback):
    """A user callback with a collective in ``on_exception`` (FAULT=exc_collective)."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def on_exception(self, trainer, pl_module, exception) -> None:
        if dist.is_available() and dist.is_initialized():
            record(self.outdir, f"rank{trainer.global_rank}", "user_exc_handler")
            dist.all_reduce(torch.ones(3))
            record(self.outdir, f"rank{trainer.global_rank}", "user_exc_handler_done")


class StockInjector(pl.Callback):
    """Stock runs: fire FTH_INJECT where the adapter would (at the start of each training batch)."""

    def __init__(self) -> None:
        from fault_tolerant_handlers.inject import Injector

        self.injector = Injector.from_env()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.injector.maybe_fire(trainer.global_rank, int(trainer.global_step) + 1, trainer.current_epoch,
                                 trainer.train_dataloader)


class IterationEvents(pl.Callback):
    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record(self.outdir, f"rank{trainer.global_rank}", "iteration_completed", iteration=trainer.global_step)


class StepSleep(pl.Callback):
    """STEP_SLEEP: every training step sleeps that many seconds (a training long enough to be signalled)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        time.sleep(STEP_SLEEP)


class SignalSelf(pl.Callback):
    """FAULT=sigterm: rank FAULT_RANK sends itself a real SIGTERM at step FAULT_STEP (a preemption)."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == FAULT_RANK and trainer.global_step == FAULT_STEP:
            record(self.outdir, f"rank{trainer.global_rank}", "fault", exc_type="sigterm")
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, trainer, pl_module) -> None:
        record(self.outdir, f"rank{trainer.global_rank}", "train_end", received_sigterm=trainer.received_sigterm)


class RecordingLauncher(_MultiProcessingLauncher):
    """ddp_spawn, test only: record what the stage raised inside each spawned rank."""

    outdir = ""

    def _wrapping_function(self, process_idx, trainer, function, args, kwargs, return_queue, global_states=None):
        name = f"rank{process_idx}"
        if os.environ.get("OWN_OUTPUT") == "1":
            from launch import own_output

            own_output(Path(self.outdir) / f"{name}.out")
        record(self.outdir, name, "start")
        record_injections(self.outdir, name)
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
        except BaseException as exc:
            record_raised(self.outdir, name, exc)
            if process_idx == FAULT_RANK and FAULT != "none":
                from launch import linger

                linger(self.outdir, process_idx, trainer.world_size, LINGER)
            raise
        record(self.outdir, name, "run_returned")


def auto_state(trainer) -> dict:
    """What the learned hang deadline (FTH_HANG_TIMEOUT_SEC=auto) of this rank knows now."""
    from fault_tolerant_handlers.lightning import FaultTolerance

    probe = next((cb.guard.auto_hang for cb in trainer.callbacks if isinstance(cb, FaultTolerance)), None)
    if probe is None:
        return {}
    return dict(step_deadline=probe.deadline("step"), checkpoint_deadline=probe.deadline("checkpoint"),
                evaluation_deadline=probe.deadline("evaluation"), longest=dict(probe.longest), steps=probe.steps)


def timed_slow(outdir: str, trainer, kind: str) -> None:
    """Work 1.3 x the deadline it is judged by: a validation, the step deadline of the time; a
    checkpoint (a kind of its own, marked from ``on_save_checkpoint`` and learned from the fast ones
    before it), its own deadline, which the rule extends once when it sees the write on the stack."""
    state = auto_state(trainer)
    limit = state.get("checkpoint_deadline" if kind == "checkpoint" else "step_deadline")
    t0 = time.monotonic()
    time.sleep(1.3 * (limit or 0.0))
    record(outdir, f"rank{trainer.global_rank}", "slow", kind=kind, seconds=time.monotonic() - t0, **state)


class AutoHangModel(TinyModel):
    """FAULT=hang and SLOW=1 (see the module's docstring)."""

    outdir = ""

    def setup(self, stage):
        if SLOW:  # a start of a known length: a first evaluation, judged by 100 x the longest piece seen
            time.sleep(0.1)  # (none of its kind yet), gets >= 10 s, above the slow validation's 1.3 x the step's
            # deadline; with a start of 0.02 s it got 2.2 s, under the 2.6 s the slow validation took
        super().setup(stage)

    def training_step(self, batch, batch_idx):
        if FAULT == "hang" and self.global_rank == FAULT_RANK and self.global_step == FAULT_STEP:
            time.sleep(0.3)  # the other rank is in the gradient all_reduce by now
            record(self.outdir, f"rank{self.global_rank}", "fault", exc_type="hang", **auto_state(self.trainer))
            time.sleep(1000)  # the hung line the report must show
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if (SLOW and self.global_rank == 0 and not self.trainer.sanity_checking and self.current_epoch == 0
                and batch_idx == 0):
            timed_slow(self.outdir, self.trainer, "validation")
        return super().validation_step(batch, batch_idx)


def slow_checkpoint_io(outdir: str, trainer):
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class SlowDisk(TorchCheckpointIO):
        """Rank 0 writes the checkpoint of step 12 slowly."""

        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            if trainer.global_step == 12 and "every12" in str(path):
                timed_slow(outdir, trainer, "checkpoint")
            super().save_checkpoint(checkpoint, path, storage_options)

    return SlowDisk()


def record_lightning_sigterm(outdir: str) -> None:
    """SIGTERM_EVENTS=1: record when Lightning's own SIGTERM handler starts and ends (and what it raised)."""
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    notifier = _SignalConnector._sigterm_notifier_fn

    def recorded(self, signum, frame):
        name = f"rank{self.trainer.global_rank}"
        record(outdir, name, "lightning_sigterm_start")
        try:
            notifier(self, signum, frame)
        except BaseException as exc:
            record(outdir, name, "lightning_sigterm_end", raised=type(exc).__name__, message=str(exc)[:500])
            raise
        record(outdir, name, "lightning_sigterm_end", raised=None)

    _SignalConnector._sigterm_notifier_fn = recorded


class RecordSigtermException(pl.Callback):
    """SIGTERM_EVENTS=1: record the exception Lightning's fit takes (``SIGTERMException`` after its handler)."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def on_exception(self, trainer, pl_module, exception) -> None:
        record(self.outdir, f"rank{trainer.global_rank}", "on_exception", exc_type=type(exception).__name__,
               message=str(exception)[:500])


def main() -> None:
    outdir = sys.argv[1]
    out = Path(outdir)
    if os.environ.get("SIGTERM_EVENTS") == "1":
        record_lightning_sigterm(outdir)
    kind = "raise" if FAULT == "exc_collective" else FAULT
    fault = None if FAULT in ("none", "sigterm", "hang") else Fault(kind, FAULT_RANK, FAULT_STEP,
                                               functools.partial(record_fault, outdir, FAULT_RANK))
    extra = [SyncOnException(outdir)] if FAULT == "exc_collective" else []
    if INJECT and not USE_FT:
        extra.append(StockInjector())
    if ITER_EVENTS:
        extra.append(IterationEvents(outdir))
    if FAULT == "sigterm":
        extra.append(SignalSelf(outdir))
    if os.environ.get("SIGTERM_EVENTS") == "1":
        extra.append(RecordSigtermException(outdir))
    if STEP_SLEEP:
        extra.append(StepSleep())
    if SLOW:
        from lightning.pytorch.callbacks import ModelCheckpoint

        extra.append(ModelCheckpoint(dirpath=out / "every12", filename="every12-{step}", every_n_train_steps=12,
                                     save_top_k=-1))
    model, data = (AutoHangModel() if FAULT == "hang" or SLOW else TinyModel()), (BenchData(fault, outdir) if FAULT == "rank_first" or WORKERS else TinyData(fault))
    model.fault = fault
    model.outdir = outdir
    strategy = "ddp_spawn" if LAUNCH == "ddp_spawn" else "ddp"
    trainer = make_trainer(strategy, out=out, fault=fault, fault_tolerance=USE_FT, on_exception_checkpoint=OEC,
                           max_epochs=2 if SLOW else 3,
                           timeout=PG_TIMEOUT, extra_callbacks=tuple(extra))
    if SLOW:
        trainer.strategy.checkpoint_io = slow_checkpoint_io(outdir, trainer)
    if strategy == "ddp_spawn":
        launcher = RecordingLauncher(trainer.strategy, start_method="spawn")
        launcher.outdir = outdir
        trainer.strategy._launcher = launcher
        name = "parent"
    else:
        name = f"rank{trainer.global_rank}"
        if os.environ.get("OWN_OUTPUT") == "1":
            from launch import own_output

            own_output(out / f"{name}.out")
        record(outdir, name, "start")
        record_injections(outdir, name)
    try:
        trainer.fit(model, datamodule=data)
    except BaseException as exc:  # noqa: BLE001
        record_raised(outdir, name, exc)
        if name == f"rank{FAULT_RANK}" and FAULT != "none":
            from launch import linger

            linger(outdir, FAULT_RANK, trainer.world_size, LINGER)
        if RERAISE:
            record(outdir, name, "exit")
            raise
    else:
        record(outdir, name, "run_returned", step=trainer.global_step, epoch=trainer.current_epoch)
    # ddp: rank 0 started rank 1; wait for it so that the harness sees every rank's record
    for proc in getattr(trainer.strategy.launcher, "procs", []) if strategy == "ddp" else []:
        try:
            proc.wait(timeout=60)
            record(outdir, name, "child_exited", returncode=proc.returncode)
        except Exception:  # noqa: BLE001
            pass
    record(outdir, name, "exit")


if __name__ == "__main__":
    main()
