"""What the data layer does in a recovery in place's phases (:mod:`..core.phases`), registered when
the package is imported (``data/__init__.py``): capture and hold the live state (:mod:`.live`), reap
the failed attempt's DataLoader workers, and forget what was kept for the recovery (:mod:`.snapshots`)."""

from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import replace

from ..core.config import WORKER_REAP
from ..core.hooks import log
from ..core import hooks
from ..core.phases import RecoveryState
from . import live, snapshots

#: The modules whose processes are DataLoader workers: torch's and this package's (the data layer).
_WORKER_MODULES = ("torch.utils.data", __name__.rsplit(".", 1)[0])


def capture_live(state: RecoveryState) -> RecoveryState:
    """``CAPTURE_LIVE``: this rank's live state of the failed attempt, or why there is none."""
    try:
        return replace(state, live=live.collect(), live_why="")
    except live.NotLive as why:
        return replace(state, live=None, live_why=str(why))


def settle_live(state: RecoveryState) -> None:
    """``SETTLE_LIVE``: the next attempt resumes from ``state.live`` (``None``: from what it loads
    itself, the plan saying why)."""
    live.hold(state.live, getattr(state.plan, "why", "") or "")


def reap_loader_workers(timeout: float = WORKER_REAP) -> int:
    """DataLoader workers of the failed attempt still alive once its objects were collected: joined,
    then killed. Returns how many had to be killed."""
    killed = 0
    deadline = time.monotonic() + timeout
    for child in multiprocessing.active_children():
        target = getattr(child, "_target", None)
        if not (getattr(target, "__module__", "") or "").startswith(_WORKER_MODULES):
            continue
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(1.0)
            killed += 1
    return killed


def reap_workers(state: RecoveryState) -> None:
    """``COLLECTED``: the attempt's loaders are collected (their workers shut down with them); those
    still running are killed."""
    killed = reap_loader_workers()
    if killed:
        log(logging.WARNING, "killed %d DataLoader worker(s) of the failed attempt that were still running", killed)


def end_recovery(state: RecoveryState) -> None:
    """``END``: the newest checkpoint's copy in memory and the live state: no attempt will read them now."""
    snapshots.forget()
    live.forget()


#: What the data layer does in each phase, in this order.
STEPS = (
    (hooks.CAPTURE_LIVE, capture_live),
    (hooks.SETTLE_LIVE, settle_live),
    (hooks.COLLECTED, reap_workers),
    (hooks.END, end_recovery),
)
