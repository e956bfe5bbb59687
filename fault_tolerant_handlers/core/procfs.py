"""The one ``/proc/<pid>/stat`` parser of the project (the watchdog, the tests' harness and the
benches use it), and the one probe the core runs itself: same-host peers by pid
(:class:`PeerPidProbe`), which the session consults at once when a collective breaks (no thread, no
store). The other probes are the detectors' (:mod:`..detect.probes`).

``/proc/<pid>/stat`` is ``pid (comm) state ppid pgrp session ...``; ``comm`` may contain spaces and
parentheses, so the fields are split after the *last* ``)``. Field numbers below are those of
``man 5 proc`` (1-based), as indices into :func:`stat_fields` (0-based, starting at field 3).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

from .failure import Ended, FailureRecord, Finding, declared_finding

STATE, PPID, PGRP, SESSION = 0, 1, 2, 3
FLAGS = 6  # field 9: the kernel's flags of the (thread group leader's) task
PF_EXITING = 0x4  # set when the process starts to exit, before its files close
START_TIME = 19  # field 22: clock ticks after boot (bench/detection.py)
EXIT_CODE = 49  # field 52: the wait status of an exited (zombie) process


def stat_fields(pid: int, tid: int | None = None) -> list[str] | None:
    """The fields after ``comm`` of ``/proc/<pid>[/task/<tid>]/stat``; ``None`` if it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def is_running(fields: list[str] | None) -> bool:
    return bool(fields) and fields[STATE] not in ("Z", "X")


def exiting(fields: list[str] | None) -> bool:
    """The process has begun to exit (``PF_EXITING``): set at once, before its files close and
    before it is a zombie (a killed process is not waitable until its last thread is gone)."""
    try:
        return fields is not None and bool(int(fields[FLAGS]) & PF_EXITING)
    except (IndexError, ValueError):
        return False


def process_state(pid: int) -> Ended | None:
    """``None`` if ``pid`` runs; otherwise how it ended, as far as this host can see (``Ended()``:
    gone, its exit status not visible from this process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return Ended()
    except OSError:
        try:
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return Ended()
        except PermissionError:
            return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[STATE] not in ("Z", "X"):
        return None
    try:
        return Ended.from_status(int(fields[EXIT_CODE]))
    except (IndexError, ValueError):
        return Ended()


def ended(pid: int, within: float) -> Ended | None:
    """How ``pid`` ended (:func:`process_state`), waiting up to ``within`` seconds while it is in
    its exit but not yet a zombie (its files, a pipe, close before the kernel shows its exit
    status). ``None`` when it runs and is not exiting."""
    deadline = time.monotonic() + within
    while True:
        how = process_state(pid)
        if how is not None:
            return how
        if not exiting(stat_fields(pid)) or time.monotonic() >= deadline:
            return None
        time.sleep(0.001)


#: Signals the library's own handler reports (:mod:`..launchers.signals`): a rank they end says so itself.
HANDLED_SIGNALS = ("SIGTERM", "SIGINT")


def unreported(how: Ended) -> bool:
    """A rank that ended ``how`` (:func:`process_state`) was killed by a signal it could not
    report itself (SIGKILL: the OOM killer; a crash)."""
    return how.killed and how.signal_name not in HANDLED_SIGNALS


# -- the one probe the core runs itself ----------------------------------------------------------------
#: How :func:`process_state` says a process ended cleanly: not a failure (a rank that
#: finished first); if this rank then waits on it, the broken collective names it.
CLEAN_EXIT = Ended(exit_code=0)


class PeerPidProbe:
    """Peers on this host, by pid: a process that is gone is declared lost (with the signal when
    the kernel still shows it; a clean exit is not a failure). A system call per peer; the store is
    asked only about a peer gone with no exit status to see (a launcher that reaps at once):
    ``left(rank)`` true (it stopped its watchdog cleanly first: ``left/<rank>``) means it finished
    first, and it is no longer watched."""

    def __init__(self, peers: Sequence[tuple[int, int]], *, by: int, host: str,
                 state: Callable[[int], Ended | None] = process_state,
                 after_failure: Callable[[], bool] = lambda: False,
                 left: Callable[[int], bool] = lambda rank: False) -> None:
        self.after_failure = after_failure  # once the job failed, peers leaving is expected
        self.left = left
        self.peers = list(peers)  # (global rank, pid)
        self.by = by
        self.host = host
        self.state = state

    def poll(self, now: float) -> Finding | None:
        for rank, pid in list(self.peers):
            state = self.state(pid)
            if state is None or state == CLEAN_EXIT:
                continue
            if self.after_failure() and not state.killed:
                continue  # a peer that ended after the failure was agreed: the job is ending
            if state.unseen and self._left(rank):
                # gone, its exit status not visible (a launcher that reaps at once), after it
                # finished first: no failure, and no longer watched. A status that shows a failure
                # (a signal, a non-zero code: ``sys.exit(1)`` under ``mp.spawn`` leaves no uncaught
                # exception for the left mark to see) is declared, left mark or not.
                self.peers.remove((rank, pid))
                continue
            return declared_finding(FailureRecord.lost(rank=rank, pid=pid, host=self.host, why=state, by=self.by))
        return None

    def _left(self, rank: int) -> bool:
        try:
            return self.left(rank)
        except Exception:  # noqa: BLE001 - no answer is no evidence that it left: declared as before
            return False
