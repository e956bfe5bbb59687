"""The one ``/proc/<pid>/stat`` parser of the project (the watchdog, the tests' harness and the
benches use it).

``/proc/<pid>/stat`` is ``pid (comm) state ppid pgrp session ...``; ``comm`` may contain spaces and
parentheses, so the fields are split after the *last* ``)``. Field numbers below are those of
``man 5 proc`` (1-based), as indices into :func:`stat_fields` (0-based, starting at field 3).
"""

from __future__ import annotations

import os
import time

from .kinds import Ended

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
