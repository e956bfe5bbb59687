"""One way to plug a layer into the core: hooks; and the log lines every layer writes (:func:`log`).

The core never imports a launcher, a detector, an adapter, the data layer or the recovery: what it
tells them and asks of them is a hook of this one table, and every layer's part is listed where the
package is assembled (``WIRING`` in ``fault_tolerant_handlers/wiring.py``). A hook is of three kinds:

**Announcements** (:func:`emit`): every callback, in order, in the emitting thread; a callback's
exception is logged, never passed to the emitter (a report must never mask the failure it reports).
Subscriptions survive a fork: the liveness helper emits ``RANK_KILLED`` to the same callbacks.

=====================  ==================================================  ==============================
hook                   emitted by, when                                    arguments
=====================  ==================================================  ==============================
``SESSION_STARTED``    ``Session.__init__``: a session is ready             ``session``
``RANK_FAILED``        this rank failed itself: ``Session.report_error``,   ``record`` (its FailureRecord)
                       the watchdog finding it hung, its own signal
``PEER_FAILED``        ``Session.take_peer_failure`` (``escalated``: the    ``table, error, escalated``
                       main thread will be told)
``ACKNOWLEDGED``       ``Session.acknowledge``: the main thread took a      ``table, error, known``
                       peer's failure and raises it
``JOB_FAILED``         this rank knows the job failed                      ``session``
``EXITING``            the watchdog ends this process with a report        ``table, error, code``
``RANK_KILLED``        the liveness helper: its rank was killed by a       ``record`` (its PeerLost)
                       signal it could not report (SIGKILL)
``RANK_ENDED``         the liveness helper: its rank ended                 ``pid, rank, host``
``SESSION_CLOSED``     ``Session.abandon``, before its connections close   ``session``
``FAILURE_SEEN``, ...  recovering in place (:mod:`.recoveries`)            ``info`` (a ``RecoveryInfo``)
=====================  ==================================================  ==============================

**Recovery steps** (:func:`run`): each ``step(state)`` over one :class:`~.phases.RecoveryState`
returns a new state or ``None``, in order; a step's exception stops the recovery unless it was
added with ``tolerate=True``.

**Providers** (:func:`provider`): what one layer answers for another, the last added answering
(``DEFER``: every one is asked whether the interrupt of a hung main thread waits at ``frame``).
"""

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


def prefix(step: int | None = None) -> str:
    """``[rank 1]`` or ``[rank 1 step 17]``."""
    if step is None:
        return f"[rank {_rank()}]"
    return f"[rank {_rank()} step {step}]"


def log(level: int, msg: str, *args: object, step: int | None = None) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, f"{prefix(step)} {msg}", *args)


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
