"""One rank of the hardening scenarios: ``python hardening_main.py <scenario> <outdir>``.

Same conventions as ``rank_main.py`` (started by ``launch.run_ranks``; events appended to
``<outdir>/rank<r>.jsonl`` with wall-clock times), with scenarios that probe the core's defences:
a caught failure followed by a later one, nested and mismatched sections, a checkpoint being
written when the watchdog would end the process, a hostile value in a polled store key, and file
descriptors over many runs.
"""

from __future__ import annotations

import io
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import rank_main
from rank_main import fault, outcome, record, run_section
from fault_tolerant_handlers import fail_together, one_rank_first, start_watchdog

RANK = rank_main.RANK


def _blocked_while_peer_fails(event: str, bad: int) -> None:
    """Rank ``bad`` fails in a section (and stays alive); the others block in a data all_reduce
    that it never joins: only their watchdogs can release them."""
    t = torch.ones(4)

    def body():
        with fail_together("step"):
            if RANK == bad:
                time.sleep(0.3)
                fault(ValueError(f"bad batch {bad}"), event=f"fault-{event}")
            record(f"entering-{event}")
            dist.all_reduce(t)

    run_section(event, body)


def caught_then_blocked() -> None:
    """Rank ``FIRST_BAD`` fails in a section that user code catches on every rank; right after it
    (no agreement in between) rank 1 fails while rank 0 is blocked in a collective. The earlier
    failure must not blind rank 0's watchdog, whether it was rank 0's own or the peer's that rank 0
    took (and acknowledged) as a ``PeerFailedError``."""
    start_watchdog()
    first_bad = int(os.environ.get("FIRST_BAD", "1"))

    def first():
        with fail_together("retryable"):
            if RANK == first_bad:
                fault(OSError("transient"), event="fault-first")

    run_section("first", first)
    record("in_step")
    _blocked_while_peer_fails("second", bad=1)
    if RANK == 1:
        time.sleep(1.5)  # alive: rank 0 can only be released by its watchdog
    record("done")


def nested() -> None:
    """Rank 1 raises in an outer section before the inner ``one_rank_first`` that rank 0 enters."""

    def body():
        with fail_together("setup"):
            if RANK == 1:
                time.sleep(0.3)
                fault(KeyError("no config"))
            with one_rank_first(name="download"):
                record("inner_body")

    run_section("nested", body)
    record("done")


def mismatched() -> None:
    """No rank fails, but the ranks meet in different sections: a bug in the job."""

    def body():
        with fail_together("evaluate" if RANK == 0 else "checkpoint"):
            pass

    run_section("mismatch", body)
    record("done")


class SlowFile(io.RawIOBase):
    """A checkpoint file that takes a while to write (a slow or network file system)."""

    def __init__(self, path: Path, seconds: float) -> None:
        self._f = open(path, "wb")
        self._delay = seconds / 40
        self._chunks = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self._chunks < 40:
            time.sleep(self._delay)
        self._chunks += 1
        return self._f.write(data)

    def close(self) -> None:
        self._f.close()
        super().close()


def checkpoint_during_exit() -> None:
    """Rank 1 fails in a section (and stays alive) while rank 0, in the same section, writes a
    checkpoint that takes longer than the exit grace. Rank 0's watchdog releases it and would end
    it after the grace: the reported exit must wait for the write, which then loads."""
    start_watchdog()
    path = Path(sys.argv[2]) / "ckpt.pt"
    torch.save({"step": 0, "w": torch.zeros(10)}, path)  # an earlier checkpoint

    def body():
        with fail_together("epoch end"):
            if RANK == 1:
                time.sleep(0.3)
                fault(ValueError("bad batch"))
            record("write_start")
            with SlowFile(path, seconds=6.0) as f:
                torch.save({"step": 7, "w": torch.arange(100_000, dtype=torch.float32)}, f)
            record("write_end")

    run_section("section", body)
    if RANK == 1:
        time.sleep(8)
    record("done")


def garbage_in_store() -> None:
    """A hostile writer sets the record counter and a heartbeat to 'abc'. The job carries on: new
    process groups can be made, and a real failure afterwards is still named."""
    from fault_tolerant_handlers.core.session import get_session

    start_watchdog()
    session = get_session()
    if RANK == 0:
        raw = session.connection("vandal", timedelta(seconds=5))  # a client of the same keys
        raw.call("set", "n", "abc")
        raw.call("set", "hb/1", "abc")
        record("vandalised")
    time.sleep(2.0)  # several watchdog polls on the bad values
    group = dist.new_group(backend="gloo")
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    record("new_group_ok", value=float(t.item()))
    _blocked_while_peer_fails("after", bad=1)
    if RANK == 1:
        time.sleep(1.5)  # alive: rank 0 can only be released by its watchdog
    record("done")


def many_runs() -> None:
    """10 Ignite runs in one process: the open file descriptors do not grow."""
    from ignite.engine import Engine

    from fault_tolerant_handlers.ignite import FaultTolerance

    def fds() -> int:
        # the fewest over 0.25 s: a stopped watchdog's threads and helper finish closing theirs
        # just after the run returns (a transient, not a leak, which stays)
        seen = []
        for _ in range(6):
            seen.append(len(os.listdir("/proc/self/fd")))
            time.sleep(0.05)
        return min(seen)

    counts = []
    for _ in range(10):
        trainer = Engine(lambda e, b: dist.all_reduce(torch.ones(1)))
        FaultTolerance(sync_every=2).attach(trainer)
        trainer.run(range(4), max_epochs=1)
        counts.append(fds())
    record("fds", counts=counts)
    record("done")


def trainer_and_evaluator() -> None:
    """A trainer and an evaluator, each with FaultTolerance (they share one watchdog: docs/design.md,
    "The watchdog"). After the first evaluation the trainer's watchdog must still
    run: in epoch 2 rank 1 fails in a section while rank 0 is blocked in a collective."""
    from ignite.engine import Engine, Events

    from fault_tolerant_handlers.ignite import FaultTolerance
    from fault_tolerant_handlers.core.session import get_session

    evaluator = Engine(lambda e, b: None)
    FaultTolerance(name="evaluate").attach(evaluator)
    trainer = Engine(lambda e, b: None)
    FaultTolerance(name="train").attach(trainer)

    @trainer.on(Events.EPOCH_COMPLETED)
    def evaluate(engine):
        evaluator.run(range(3))
        watchdog = get_session().watchdog
        record("after_evaluation", epoch=engine.state.epoch, running=watchdog is not None and not watchdog.stopped)

    @trainer.on(Events.ITERATION_COMPLETED(once=6))
    def fail_in_epoch_two(engine):
        _blocked_while_peer_fails("epoch2", bad=1)
        if RANK == 1:
            time.sleep(1.5)
        record("done")
        raise SystemExit(0)

    try:
        trainer.run(range(4), max_epochs=3)
    except SystemExit:
        pass


def gil_held() -> None:
    """Rank 1's main thread holds the GIL for 20 s in one C call at iteration 5 (its watchdog
    threads cannot run) while rank 0 waits for it in the gradient all_reduce; then both finish.
    Nobody may be declared lost: the heartbeat comes from the liveness process."""
    import ctypes

    from ignite.engine import Engine, Events

    from fault_tolerant_handlers.ignite import FaultTolerance

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(engine, batch):
        if RANK == 1 and engine.state.iteration == 5:
            record("gil_start")
            ctypes.PyDLL(None).sleep(20)  # a C call that keeps the GIL
            record("gil_end")
        loss = model(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    trainer = Engine(step)
    FaultTolerance(sync_every=5).attach(trainer)
    trainer.run(range(10), max_epochs=1)
    record("done")


SCENARIOS = {f.__name__: f for f in (gil_held, trainer_and_evaluator, caught_then_blocked, nested, mismatched, checkpoint_during_exit,
                                     garbage_in_store, many_runs)}


if __name__ == "__main__":
    rank_main.main(SCENARIOS)
