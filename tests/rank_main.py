"""One rank of a multi-process test: ``python rank_main.py <scenario> <outdir>``.

Started by ``launch.run_ranks`` with torchrun's environment. It initializes gloo with a short
process-group timeout, runs the scenario, and appends what it saw to ``<outdir>/rank<r>.jsonl``.
Faults are injected here, on purpose, at a chosen rank; every event carries a wall-clock time so
the test can measure how long after the fault each rank stopped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fault_tolerant_handlers import PeerFailedError, fail_together, one_rank_first, start_watchdog
from launch import read_events

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
OUT: Path


def record(event: str, **fields) -> None:
    fields.update(event=event, rank=RANK, t=time.time())
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def outcome(event: str, exc: BaseException | None, **fields) -> None:
    """Record what a section ended with on this rank."""
    if exc is None:
        record(event, raised=None, **fields)
    elif isinstance(exc, PeerFailedError):
        record(
            event,
            raised="PeerFailedError",
            failed_rank=exc.failed_rank,
            exc_type=exc.exc_type,
            exc_message=exc.exc_message,
            remote_traceback=exc.remote_traceback,
            where=exc.where,
            others=exc.others,
            failed_at=exc.failed_at,
            message=str(exc),
            **fields,
        )
    else:
        record(event, raised=type(exc).__name__, message=str(exc), **fields)


def fault(exc: BaseException, event: str = "fault") -> None:
    """Raise ``exc`` here, after recording the moment of the fault."""
    record(event, exc_type=type(exc).__name__, message=str(exc))
    raise exc


def _wait_for_fault(rank: int, message: str, bound: float = 10.0) -> None:
    """Block until ``rank`` has recorded a fault with ``message`` in its events (same host, same dir)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if any(e.get("event") == "fault" and e.get("message") == message for e in read_events(OUT, rank)):
            return
        time.sleep(0.01)
    raise TimeoutError(f"rank {rank} recorded no fault {message} within {bound} s")


def run_section(event: str, body, **fields) -> None:
    try:
        body()
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        outcome(event, exc, **fields)
    else:
        outcome(event, None, **fields)


# -- scenarios ------------------------------------------------------------------------------------


def fail_each() -> None:
    """A fault on each rank in turn; the other ranks keep working a little inside the section."""
    for bad in range(WORLD):

        def body():
            with fail_together("load data"):
                if RANK == bad:
                    time.sleep(0.2)
                    fault(ValueError(f"bad sample {17 + bad}"))
                time.sleep(0.05)

        run_section(f"section{bad}", body, bad=bad)
    with fail_together("after"):  # ranks are still in lockstep: a clean section passes
        pass
    record("done")


def non_ascii() -> None:
    """Rank 1 raises a ValueError of 2,000 characters outside ASCII from a deep stack (a message and a
    traceback of a user's own language: 3 bytes a character in UTF-8)."""

    def deep(n: int) -> None:
        if n:
            deep(n - 1)  # \u68c0\u67e5\u70b9\u6570\u636e: one frame of many, each in the traceback
        elif RANK == 1:
            time.sleep(0.2)
            fault(ValueError("\u6837\u672c\u635f\u574f" * 500))

    def body():
        with fail_together("\u52a0\u8f7d\u6570\u636e"):
            deep(40)
            time.sleep(0.05)

    run_section("section", body)
    record("done")


def two_fail() -> None:
    """Ranks 1 and 2 fail in the same section, in both orders: the second 300 ms after the first's
    fault has happened (it waits for the first's recorded fault, not for a fixed time after its own
    entry, since the ranks enter the section at different times)."""
    for first, second in ((1, 2), (2, 1)):

        def body():
            with fail_together("two"):
                if RANK == first:
                    fault(KeyError(f"first{first}"))
                if RANK == second:
                    _wait_for_fault(first, f"'first{first}'")
                    time.sleep(0.3)
                    fault(IndexError(f"second{second}"))

        run_section(f"two-{first}-{second}", body, first=first, second=second)
    record("done")


def caught_outside() -> None:
    """User code catches the failure around the section and goes on to a data-group collective."""
    bad = WORLD - 1
    t = torch.ones(1)
    try:
        with fail_together("risky"):
            if RANK == bad:
                fault(RuntimeError("caught by the user"))
    except Exception as exc:
        outcome("section", exc)
    dist.all_reduce(t)  # would deadlock if some rank had not left the section
    record("after_collective", value=float(t.item()))
    record("done")


def report_inside() -> None:
    """User code catches the failure inside the section and reports it."""
    bad = 0
    t = torch.ones(1)

    def body():
        with fail_together("evaluate") as section:
            try:
                if RANK == bad:
                    fault(FileNotFoundError("metrics.csv"))
            except FileNotFoundError as err:
                section.report_error(err)
            dist.all_reduce(t)  # the rest of the section still runs on every rank

    run_section("section", body)
    record("done", value=float(t.item()))


def _first_body(first: int, fail_rank: int | None, event: str, local: bool = False) -> None:
    def body():
        with one_rank_first(rank=first, local=local, name="download"):
            record(f"{event}:body_start")
            time.sleep(0.3 if RANK == fail_rank else 0.05)
            if RANK == fail_rank:
                fault(OSError(f"download failed on rank {RANK}"))
            record(f"{event}:body_end")

    run_section(event, body, first=first, fail_rank=fail_rank)


def rank_first_each() -> None:
    """The first rank fails inside ``one_rank_first``, for each rank as the first."""
    for first in range(WORLD):
        _first_body(first, first, f"first{first}")
    _first_body(0, None, "clean")
    record("done")


def rank_first_late() -> None:
    """The first rank succeeds; the last rank fails in its turn."""
    _first_body(0, WORLD - 1, "late")
    record("done")


def rank_first_local() -> None:
    """Two simulated nodes of two ranks (launcher env): local rank 0 of each goes first; global
    rank 2 (local rank 0 of node 1) fails."""
    _first_body(0, 2, "local", local=True)
    _first_body(0, None, "local_clean", local=True)
    record("done")


def bad_input() -> None:
    for rank in (WORLD, -1, 1.5, True):
        try:
            one_rank_first(rank=rank).__enter__()
        except (TypeError, ValueError) as exc:
            outcome(f"rank={rank!r}", exc)
        else:
            outcome(f"rank={rank!r}", None)
    sub = dist.new_group([0])  # collective on every rank; only rank 0 is a member
    try:
        with fail_together("sub", group=sub):
            pass
    except (TypeError, ValueError) as exc:
        outcome("group", exc)
    else:
        outcome("group", None)
    try:
        fail_together(None)  # type: ignore[arg-type]
    except TypeError as exc:
        outcome("name", exc)
    with fail_together("still fine"):
        pass
    record("done")


def _download_with_retries(section) -> None:
    """A common pattern: rank 0 downloads first; on failure every rank retries after a backoff.
    Rank 0's download always fails, and rank 0 catches it to retry, so its process stays alive."""
    for attempt in range(2):
        try:
            with section():
                if RANK == 0:
                    fault(ConnectionError(f"mirror unreachable (attempt {attempt})"), event=f"fault{attempt}")
                record("body_ran", attempt=attempt)
            return
        except Exception as exc:  # noqa: BLE001
            outcome(f"attempt{attempt}", exc)
            time.sleep(4.0)  # backoff
    record("gave_up")


def retry_ours() -> None:
    _download_with_retries(lambda: one_rank_first(rank=0))
    record("done")


def retry_stock() -> None:
    import ignite.distributed as idist

    _download_with_retries(lambda: idist.one_rank_first(rank=0))
    record("done")


def blocked_release() -> None:
    """Rank 1 fails inside a section while rank 0 is blocked in a data all_reduce that rank 1
    never joins; rank 1 stays alive afterwards, so only the watchdog can release rank 0."""
    start_watchdog()
    t = torch.ones(4)

    def body():
        with fail_together("step"):
            if RANK == 1:
                time.sleep(0.3)
                fault(ValueError("bad batch 5"))
            record("entering_collective")
            dist.all_reduce(t)

    run_section("section", body)
    if RANK == 1:
        time.sleep(float(os.environ.get("LINGER", "5")))
    record("done")


def reported_exit() -> None:
    """As ``blocked_release`` but with FTH_RELEASE=exit: rank 0 cannot be released in-process, so
    its watchdog ends it with a report and EXIT_PEER_FAILED."""
    blocked_release()


def send_to_killed() -> None:
    """Rank 1 posts a receive of 256 MB and stops itself (SIGSTOP: nothing reads its connection);
    rank 0 sends it the tensor and, once its send is under way, SIGKILLs it. gloo does not fail a send
    already queued on a connection that closes: rank 0's send waits for the group's timeout, and its
    release finds nothing left to cut. Its watchdog names the loss, releases, and ends it."""
    start_watchdog()
    big = torch.ones(64 << 20)
    if RANK == 1:
        work = dist.irecv(big, src=0)
        record("posted")
        os.kill(os.getpid(), signal.SIGSTOP)
        work.wait()
        return
    deadline = time.monotonic() + 10
    while not any(e.get("event") == "posted" for e in read_events(OUT, 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    peer = next(e["pid"] for e in read_events(OUT, 1) if e.get("event") == "start")

    def kill() -> None:
        record("fault", exc_type="SIGKILL", message="rank 1 killed while rank 0 sends to it")
        os.kill(peer, signal.SIGKILL)

    threading.Timer(1.0, kill).start()

    def body():
        with fail_together("send"):
            record("entering_collective")
            dist.send(big, 1)

    run_section("section", body)


def step_sections() -> None:
    """A loop of one ``fail_together`` section per step, given its step: ``FTH_INJECT`` (set by the
    test) fires as the section of its iteration begins, and that section fails on every rank."""
    def body():
        for step in range(1, 11):
            record("step", step=step)
            with fail_together("step", step=step, epoch=0):
                time.sleep(0.01)

    run_section("loop", body)


SCENARIOS = {f.__name__: f for f in (blocked_release, step_sections, reported_exit, send_to_killed, fail_each, non_ascii, two_fail, caught_outside, report_inside, rank_first_each,
                                     rank_first_late, rank_first_local, bad_input, retry_ours, retry_stock)}


def main(scenarios: dict | None = None) -> None:
    """Run ``sys.argv[1]`` of ``scenarios`` (this file's by default) with events in ``sys.argv[2]``."""
    global OUT
    scenario, OUT = sys.argv[1], Path(sys.argv[2])
    timeout = timedelta(seconds=float(os.environ.get("FTH_TEST_PG_TIMEOUT", "20")))
    dist.init_process_group("gloo", timeout=timeout)
    record("start", pid=os.getpid())
    try:
        (scenarios or SCENARIOS)[scenario]()
    except BaseException as exc:
        outcome("uncaught", exc)
        raise
    finally:
        record("exit")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
