"""Which attempt of the job this process runs: torchrun's restart ``r`` (``TORCHELASTIC_RESTART_COUNT``)
and, inside it, the recoveries in place ``g`` = 0, 1, ... The job's attempt is ``r + g`` (what
``FTH_INJECT``'s ``attempt=`` counts); each ``(r, g)`` has a store namespace of its own (:func:`namespace`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

#: Set by torchrun in every worker it starts (0, 1, ... one per restart of its workers).
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"

_in_place = 0


def restart() -> int:
    """torchrun's restart count (0 without torchrun, or when the variable is malformed)."""
    value = os.environ.get(RESTART_ENV, "0").strip()
    return int(value) if value.isdigit() else 0


def under_torchrun() -> bool:
    """Launched by torchrun, whose store lives in its agent and outlives any worker."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def agent_store(timeout: timedelta) -> dist.TCPStore:
    """A new connection to torchrun's agent store (``MASTER_ADDR:MASTER_PORT``): the one way in."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


def in_place() -> int:
    return _in_place


def set_in_place(count: int) -> None:
    global _in_place
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"in-place recovery count must be an int >= 0, got {count!r}")
    _in_place = count


def current() -> int:
    return restart() + _in_place


def namespace() -> str:
    """The store namespace of this attempt's process groups: ``fth/attempt_<r>`` (as before any
    recovery in place), then ``fth/attempt_<r>.<g>`` after the ``g``-th recovery."""
    return f"fth/attempt_{restart()}" + (f".{_in_place}" if _in_place else "")


# -- the process that runs the recovery ---------------------------------------------------------------
#: Set by ``recover_in_place`` in its process's environment while it runs (its pid): a rank that finds
#: its parent's pid there was spawned by the function the recovery wraps. Not a setting.
RUNNING_ENV = "FTH_RECOVER_IN_PLACE_PID"

_running_pid: int | None = None  # a pid, not a flag: a forked child inherits this module's state


def enter_recovery() -> tuple[int | None, str | None]:
    """``recover_in_place`` starts in this process; returns what :func:`leave_recovery` restores."""
    global _running_pid
    previous = (_running_pid, os.environ.get(RUNNING_ENV))
    _running_pid = os.getpid()
    os.environ[RUNNING_ENV] = str(_running_pid)
    return previous


def leave_recovery(previous: tuple[int | None, str | None]) -> None:
    global _running_pid
    _running_pid, env = previous
    if env is None:
        os.environ.pop(RUNNING_ENV, None)
    else:
        os.environ[RUNNING_ENV] = env


def recovering() -> bool:
    """``recover_in_place`` runs in this process (not merely in the one it was forked from)."""
    return _running_pid == os.getpid()


def spawned_by_recovery() -> int | None:
    """The parent's pid when a process running ``recover_in_place`` spawned this one (which runs none):
    the recovery wraps the launcher, and cannot recover this rank in place; ``None`` otherwise."""
    parent = os.getppid()
    if recovering() or os.environ.get(RUNNING_ENV) != str(parent):
        return None
    return parent
