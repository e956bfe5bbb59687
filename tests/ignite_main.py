"""One rank of an Ignite multi-process test: a real DDP training with an injected fault.

    python ignite_main.py <outdir>          (env: RANK/WORLD_SIZE/... as torchrun gives them)
    LAUNCH=parallel python ignite_main.py <outdir>   (idist.Parallel spawns the ranks itself)

Environment:
    FAULT        step | data | handler | rank0_handler | exc_collective | evaluator | none
                 | kill (SIGKILL itself) | sigterm | sigint (signals itself) | hang (time.sleep) | stop (SIGSTOP itself: even its watchdog is silent)
                 | freeze (the whole job, every rank and its helpers, stopped for FREEZE seconds in a step
                 of FAULT_RANK's, then continued, as a scheduler suspends and resumes a job: the step's
                 own work is 0.8 s, before and after; recorded as ``fault`` and ``resumed``)
                 | rank_first (FAULT_RANK raises inside a one_rank_first block before training: ours with
                 USE_FT=1, ignite.distributed.one_rank_first with USE_FT=0)
    HANG         hang_timeout in seconds for FaultTolerance, or ``auto`` (default: off)
    SLOW         1 (with HANG=auto): long but normal work on rank 0 (rank 1 waits for it in the gradient
                 all_reduce), each 1.3 x rank 0's learned step deadline of the time: an evaluator Engine
                 run from an ITERATION_COMPLETED handler at iteration 6, a plain evaluation in an
                 EPOCH_COMPLETED handler after epoch 1, a checkpoint written to a slow file at iteration
                 12; each is recorded as a ``slow`` event
    WORKERS      DataLoader workers (default 0)
    FAULT_RANK   rank that fails (default 1)
    FAULT_ITER   iteration at which it fails (default 3)
    USE_FT       1: attach FaultTolerance; 0: stock Ignite
    LINGER       the failing rank stays alive after its run raised until every other rank recorded
                 the end of its run, at most this many seconds (default 8), so that the other ranks
                 are not released by its exit (``launch.linger``)
    RERAISE      1: re-raise what the run raised after recording it (the process fails, as a real script's)
    FTH_INJECT   as the adapter reads it; with USE_FT=0 this program fires it itself at the same point
                 (ITERATION_STARTED), so that stock runs get the same fault. Either way the injection is
                 recorded as the ``fault`` event (and DataLoader restarts as ``dataloader_restart``)
    ITER_EVENTS  1: record ``iteration_completed`` events (to time a recovery)
    STEP_SLEEP   seconds every step sleeps (default 0): steps of a known length
    OWN_OUTPUT   1: each rank's stdout and stderr go to ``<outdir>/rank<r>.out`` from its start (under
                 ``idist.Parallel`` the ranks share the parent's otherwise), so that what one rank
                 printed is known
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from ignite.metrics import MeanSquaredError
from torch import nn
from torch.utils.data import Dataset

FAULT = os.environ.get("FAULT", "step")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_ITER = int(os.environ.get("FAULT_ITER", "3"))
USE_FT = os.environ.get("USE_FT", "1") == "1"
LINGER = float(os.environ.get("LINGER", "8"))
HANG = os.environ.get("HANG") or None
HANG = HANG if HANG in (None, "auto") else float(HANG)
SLOW = os.environ.get("SLOW") == "1"
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))
FREEZE = float(os.environ.get("FREEZE", "3"))
WORKERS = int(os.environ.get("WORKERS", "0"))
RERAISE = os.environ.get("RERAISE") == "1"
ITER_EVENTS = os.environ.get("ITER_EVENTS") == "1"
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("FTH_TEST_PG_TIMEOUT", "20")))
BATCH = 4
N = 64


class Samples(Dataset):
    def __init__(self, bad_index: int | None, on_bad=None):
        self.on_bad = on_bad
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 8, generator=g)
        self.y = torch.randn(N, 1, generator=g)
        self.bad_index = bad_index

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == self.bad_index:
            self.on_bad(ValueError(f"bad sample {i}"))
        return self.x[i], self.y[i]


class RecordInjected(logging.StreamHandler):
    """With FTH_INJECT: record the injected fault and DataLoader restarts as events. It still prints
    WARNING and above to stderr, as logging's last-resort handler would without it."""

    def __init__(self, record) -> None:
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)
        self.record_event = record

    def emit(self, rec: logging.LogRecord) -> None:
        msg = rec.getMessage()
        if "FTH_INJECT" in msg and "injecting" in msg:
            self.record_event("fault", exc_type="injected", message=msg)
        elif "restarting workers" in msg:
            self.record_event("dataloader_restart", message=msg)
        super().emit(rec)


def training(local_rank: int, outdir: str) -> None:
    out = Path(outdir)
    rank, world = idist.get_rank(), idist.get_world_size()

    def record(event: str, **fields) -> None:
        fields.update(event=event, rank=rank, t=time.time())
        with open(out / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(fields, default=str) + "\n")

    def fault(exc: BaseException) -> None:
        record("fault", exc_type=type(exc).__name__, message=str(exc))
        raise exc

    def ended(exc: BaseException) -> None:
        fields = dict(raised=type(exc).__name__, message=str(exc)[:2000])
        for attr in ("failed_rank", "exc_type", "exc_message", "where", "step", "epoch"):
            if hasattr(exc, attr):
                fields[attr] = getattr(exc, attr)
        record("run_raised", **fields)
        if rank == FAULT_RANK and FAULT != "none":
            from launch import linger

            linger(out, rank, world, LINGER)
        record("exit")
        if RERAISE:
            raise exc

    if os.environ.get("OWN_OUTPUT") == "1":
        from launch import own_output

        own_output(out / f"rank{rank}.out")
    record("start", pid=os.getpid())
    if os.environ.get("FTH_INJECT", "").strip():
        logging.getLogger("fault_tolerant_handlers").addHandler(RecordInjected(record))
    if FAULT == "rank_first":  # e.g. a dataset download that only the first rank does
        if USE_FT:
            from fault_tolerant_handlers import one_rank_first as first
        else:
            first = idist.one_rank_first
        try:
            with first():
                if rank == FAULT_RANK:
                    fault(OSError("mirror unreachable: https://example.invalid/data.tar.gz"))
        except BaseException as exc:  # noqa: BLE001
            ended(exc)
            return
    torch.manual_seed(0)
    model = idist.auto_model(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    bad_index = None
    if FAULT == "data" and rank == FAULT_RANK:
        # the first sample of batch FAULT_ITER on this rank (DistributedSampler, no shuffle)
        bad_index = FAULT_RANK + idist.get_world_size() * (FAULT_ITER - 1) * BATCH
    loader = idist.auto_dataloader(Samples(bad_index, fault if bad_index is not None else None),  # spawn workers pickle it
                                   batch_size=BATCH * idist.get_world_size(), shuffle=False,
                                   num_workers=WORKERS, persistent_workers=WORKERS > 0)
    if os.environ.get("RESTARTABLE") == "1":
        from fault_tolerant_handlers import make_restartable

        loader = make_restartable(loader)

    ft = None

    def auto_state() -> dict:
        """What the learned hang deadline knows now (HANG=auto)."""
        probe = ft.guard.auto_hang if ft is not None else None
        if probe is None:
            return {}
        return dict(step_deadline=probe.deadline("step"), longest=dict(probe.longest), steps=probe.steps)

    def step(engine, batch):
        x, y = batch
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        if FAULT in ("step", "exc_collective") and rank == FAULT_RANK and engine.state.iteration == FAULT_ITER:
            time.sleep(0.3)  # the other ranks are already in the gradient all_reduce
            fault(RuntimeError(f"CUDA-like failure at iteration {engine.state.iteration}"))
        if FAULT in ("kill", "hang", "stop", "sigterm", "sigint", "freeze") and rank == FAULT_RANK and engine.state.iteration == FAULT_ITER:
            time.sleep(0.3)  # the other ranks are already in the gradient all_reduce
            record("fault", exc_type=FAULT, message=f"{FAULT} at iteration {FAULT_ITER}", **auto_state())
            if FAULT == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif FAULT in ("sigterm", "sigint"):  # a real signal, as a scheduler or Ctrl-C sends it
                os.kill(os.getpid(), signal.SIGTERM if FAULT == "sigterm" else signal.SIGINT)
            elif FAULT == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif FAULT == "freeze":
                from launch import freeze_job

                freeze_job(outdir, after=0.3, seconds=FREEZE)
                time.sleep(0.3 + FREEZE + 0.5)  # 0.8 s of its own, the freeze in the middle
                record("resumed", **auto_state())
            else:
                time.sleep(1000)  # the hung line the report must show
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    evaluator = Engine(lambda e, b: (model(b[0]), b[1]))
    MeanSquaredError().attach(evaluator, "mse")  # all_reduces across ranks in compute()

    if FAULT == "evaluator":
        @evaluator.on(Events.ITERATION_COMPLETED)
        def _eval_fault(e):
            if rank == FAULT_RANK and e.state.iteration == 2:
                fault(KeyError("missing label column"))

        @trainer.on(Events.EPOCH_COMPLETED)
        def _evaluate(e):
            evaluator.run(loader)

    if FAULT == "handler":
        @trainer.on(Events.ITERATION_COMPLETED)
        def _check(e):
            if rank == FAULT_RANK and e.state.iteration == FAULT_ITER:
                fault(ZeroDivisionError("metric denominator is 0"))

    if FAULT == "rank0_handler" and rank == 0:
        @trainer.on(Events.EPOCH_COMPLETED)
        def _log_to_disk(e):  # a logger that only rank 0 runs
            fault(PermissionError("cannot write /logs/epoch1.json"))

    if FAULT == "exc_collective":
        @trainer.on(Events.EXCEPTION_RAISED)
        def _sync_metrics(e, exc):  # a user handler with a collective, on every rank
            record("user_exc_handler", exc_type=type(exc).__name__)
            t = torch.ones(3)
            idist.all_reduce(t)
            record("user_exc_handler_done")

    if SLOW:
        def slow_seconds() -> tuple[float, dict]:
            state = auto_state()
            return 1.3 * (state.get("step_deadline") or 0.0), state

        def timed(kind: str, work) -> None:
            seconds, state = slow_seconds()
            t0 = time.monotonic()
            work(seconds)
            record("slow", kind=kind, seconds=time.monotonic() - t0, **state)

        class SlowFile(io.BytesIO):  # a checkpoint written to a slow file system
            def __init__(self, seconds: float) -> None:
                super().__init__()
                self.delay = seconds

            def write(self, data) -> int:
                if self.delay:
                    time.sleep(self.delay)
                    self.delay = 0.0
                return super().write(data)

        def nested_evaluation(seconds: float) -> None:
            Engine(lambda e, b: time.sleep(seconds / 3)).run([0, 1, 2], max_epochs=1)

        if rank == 0:
            trainer.add_event_handler(Events.ITERATION_COMPLETED(once=6),
                                      lambda e: timed("nested evaluation", nested_evaluation))
            trainer.add_event_handler(Events.EPOCH_COMPLETED(once=1), lambda e: timed("epoch-end evaluation", time.sleep))
            trainer.add_event_handler(Events.ITERATION_COMPLETED(once=12),
                                      lambda e: timed("checkpoint", lambda s: torch.save(model.state_dict(), SlowFile(s))))

    if ITER_EVENTS:
        @trainer.on(Events.ITERATION_COMPLETED)
        def _iteration_done(e):
            record("iteration_completed", iteration=e.state.iteration)

    if not USE_FT and os.environ.get("FTH_INJECT", "").strip():  # stock: the same injection, fired here
        from fault_tolerant_handlers.inject import Injector

        injector = Injector.from_env()

        @trainer.on(Events.ITERATION_STARTED)
        def _inject(e):
            injector.maybe_fire(rank, e.state.iteration, e.state.epoch, e.state.dataloader)

    if USE_FT:
        from fault_tolerant_handlers.ignite import FaultTolerance

        from datetime import timedelta as _td

        ft = FaultTolerance(sync_every=2, hang_timeout=HANG if HANG in (None, "auto") else _td(seconds=HANG))
        ft.attach(trainer)

    try:
        trainer.run(loader, max_epochs=3)
    except BaseException as exc:  # noqa: BLE001
        ended(exc)
        return
    record("run_returned", iteration=trainer.state.iteration, epoch=trainer.state.epoch,
           dataloader_restarts=getattr(trainer.state, "dataloader_restarts", None))
    record("exit")


def main() -> None:
    outdir = sys.argv[1]
    if os.environ.get("LAUNCH") == "parallel":
        with idist.Parallel(backend="gloo", nproc_per_node=2, timeout=PG_TIMEOUT) as parallel:
            parallel.run(training, outdir)
        return
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    training(int(os.environ["LOCAL_RANK"]), outdir)


if __name__ == "__main__":
    main()
