"""One way to plug a layer into the core: hooks (announcements, recovery steps, providers; listed in
``WIRING``, ``fault_tolerant_handlers/wiring.py``; docs/architecture.md, "Hooks"), and the log lines
every layer writes (:func:`log`)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

# -- log lines: the rank (and, where known, the step) in front of every message ------------------------
logger = logging.getLogger("fault_tolerant_handlers")
_last_rank: str | None = None  # the rank as last seen in an initialized group (kept after teardown)


def _rank() -> str:
    global _last_rank
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            _last_rank = str(dist.get_rank())
            return _last_rank
    except Exception:  # pragma: no cover - logging must never raise
        pass
    return _last_rank or os.environ.get("RANK", "?")


def log(level: int, msg: str, *args: object, step: int | None = None) -> None:
    """``msg`` after ``[rank 1]`` or ``[rank 1 step 17]``."""
    if logger.isEnabledFor(level):
        logger.log(level, f"[rank {_rank()}{'' if step is None else f' step {step}'}] {msg}", *args)


def first_line(text: object, limit: int | None = 200) -> str:
    """The first line of ``text`` (an exception's message), at most ``limit`` characters: what a log
    line or a short reason shows of an error."""
    return (str(text).splitlines() or [""])[0][:limit]


ANNOUNCEMENTS = (SESSION_STARTED, RANK_FAILED, PEER_FAILED, ACKNOWLEDGED, JOB_FAILED, EXITING, RANK_KILLED, RANK_ENDED,
                 SESSION_CLOSED, FAILURE_SEEN, RECOVERY_STARTED, RECOVERED) = (
    "session started", "rank failed", "peer failed", "failure acknowledged", "job failed", "exiting", "rank killed",
    "rank ended", "session closed", "failure seen", "recovery started", "recovered")
#: A recovery's steps, in the order it reaches them.
STEPS = (BEGIN, CAPTURE_LIVE, SETTLE_LIVE, TEAR_DOWN, RESET_FRAMEWORKS, COLLECTED, RE_FORM, END) = (
    "begin", "capture live state", "settle live state", "tear down", "reset frameworks", "collected", "re-form", "end")
PROVIDERS = (WORLD, WATCHDOG, DEFER, INTERRUPT, LOSE, KEEPER_PID) = (
    "world", "watchdog", "defer", "interrupt", "lose", "keeper pid")
HOOKS = ANNOUNCEMENTS + STEPS + PROVIDERS

_hooks: dict[str, tuple[tuple[Callable[..., Any], bool], ...]] = {hook: () for hook in HOOKS}
_lock = threading.Lock()


def add(hook: str, callback: Callable[..., Any], *, tolerate: bool = False) -> None:
    """Add ``callback`` to ``hook``, after those added before it (once, however often added).
    ``tolerate`` (a recovery step): its exception is logged and the recovery goes on."""
    if hook not in _hooks:
        raise ValueError(f"add(hook, callback): unknown hook {hook!r}; the hooks are {', '.join(HOOKS)}")
    if not callable(callback):
        raise TypeError(f"add(hook, callback): callback must be callable, got {callback!r}")
    with _lock:
        if all(c != callback for c, _ in _hooks[hook]):
            _hooks[hook] = (*_hooks[hook], (callback, tolerate))  # replaced, never mutated: readers take no lock


def remove(hook: str, callback: Callable[..., Any]) -> None:
    with _lock:
        _hooks[hook] = tuple(entry for entry in _hooks[hook] if entry[0] != callback)


def callbacks(hook: str) -> tuple[Callable[..., Any], ...]:
    return tuple(c for c, _ in _hooks[hook])


def provider(hook: str) -> Callable[..., Any] | None:
    """The callback that answers ``hook`` (the last added), or ``None``."""
    found = _hooks[hook]
    return found[-1][0] if found else None


def _name(callback: Callable[..., Any]) -> str:
    return getattr(callback, "__qualname__", repr(callback))


def emit(hook: str, *args: object) -> None:
    """Tell every callback of ``hook``; never raises (a callback's error is logged)."""
    for callback, _ in _hooks[hook]:
        try:
            callback(*args)
        except Exception as err:  # noqa: BLE001 - a report must never mask the failure it reports
            log(logging.WARNING, "%s: a callback (%s) failed: %s", hook, _name(callback),
                first_line(err))


def run(hook: str, state: Any) -> Any:
    """Run the steps of ``hook`` in order over ``state``; returns the state the last one left."""
    for step, tolerate in _hooks[hook]:
        try:
            new = step(state)
        except Exception as err:
            if not tolerate:
                raise
            log(logging.WARNING, "recovery step %s: %s failed, the recovery goes on: %s: %s", hook, _name(step),
                type(err).__name__, first_line(err))
            continue
        if new is not None:
            if type(new) is not type(state):
                raise TypeError(f"recovery step {hook}: {_name(step)} returned {type(new).__name__}, not a "
                                f"{type(state).__name__} or None")
            state = new
    return state
