"""What the data layer does in a recovery in place's phases (:mod:`..core.phases`), wired in
:mod:`..wiring`: capture and hold the live state (:mod:`.live`), reap
the failed attempt's DataLoader workers, and forget what was kept for the recovery (:mod:`.snapshots`)."""

from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import replace

from ..core.config import WORKER_REAP
from ..core.hooks import log
from ..core.phases import RecoveryState
from . import live, snapshots

#: The modules whose processes are DataLoader workers: torch's and this package's (the data layer).
_WORKER_MODULES = ("torch.utils.data", __name__.rsplit(".", 1)[0])


def capture_live(state: RecoveryState) -> RecoveryState:
    """``CAPTURE_LIVE``: this rank's live state of the failed attempt, or why there is none."""
    copies = live.replica_copies()  # the replicas stopped first: nothing sent or received from here on
    try:
        return replace(state, live=live.collect(), live_why="", copies=copies)
    except live.NotLive as why:
        return replace(state, live=None, live_why=str(why), copies=copies)


def settle_live(state: RecoveryState) -> None:
    """``SETTLE_LIVE``: the next attempt resumes from ``state.live`` (``None``: from what it loads itself)."""
    live.hold(state.live, getattr(state.plan, "why", "") or "")


def reap_workers(state: RecoveryState) -> None:
    """``COLLECTED``: DataLoader workers still running once the attempt's loaders are collected:
    joined, then killed."""
    killed, deadline = 0, time.monotonic() + WORKER_REAP
    for child in multiprocessing.active_children():
        target = getattr(child, "_target", None)
        if not (getattr(target, "__module__", "") or "").startswith(_WORKER_MODULES):
            continue
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(1.0)
            killed += 1
    if killed:
        log(logging.WARNING, "killed %d DataLoader worker(s) of the failed attempt that were still running", killed)


def end_recovery(state: RecoveryState) -> None:
    """``END``: the newest checkpoint's copy in memory and the live state: no attempt will read them now."""
    snapshots.forget()
    live.forget()
