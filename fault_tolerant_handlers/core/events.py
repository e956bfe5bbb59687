"""What the core announces, and who listens: the core never calls a launcher or a reporter.

The core (and the detectors) *emit* an event when something happens that the outside world must
learn; the launcher reporters (:mod:`..launchers`) *subscribe* when the package is imported
(``fault_tolerant_handlers/launchers/__init__.py``). A subscriber runs in the emitting thread, in
the order of subscription, and an exception it raises is logged, never passed to the emitter (a
report must never mask the failure being reported). Subscriptions are process-wide and survive a
fork: the liveness helper, forked from its rank, emits :data:`RANK_KILLED` to the same subscribers.

=====================  ================================================  ===================================
event                  emitted by, when                                  arguments
=====================  ================================================  ===================================
``SESSION_STARTED``    ``Session.__init__``: a session is ready           ``session``
``RANK_FAILED``        this rank failed itself: ``Session.report_error``, ``record`` (its own FailureRecord)
                       the watchdog finding it hung, its own signal
``PEER_FAILED``        ``Session.take_peer_failure``: the watchdog found   ``table, error, escalated``
                       a peer's failure (``escalated``: it became this
                       rank's incident, the main thread will be told)
``ACKNOWLEDGED``       ``Session.acknowledge``: the main thread took a    ``table, error, known``
                       peer's failure and raises it
``JOB_FAILED``         this rank knows the job failed: its own failure    ``session``
                       (``report_error``), a failed agreement, the
                       watchdog's finding, ``acknowledge``
``EXITING``            the watchdog ends this process with a report       ``table, error, code``
``RANK_KILLED``        the liveness helper: its rank was killed by a      ``record`` (its PeerLost)
                       signal it could not report (SIGKILL)
``RANK_ENDED``         the liveness helper: its rank ended (after         ``pid, rank, host``
                       ``RANK_KILLED`` was told to the peers)
``SESSION_CLOSED``     ``Session.close``, before its connections close    ``session``
``FAILURE_PHASE``      a transition changed the phase of a session's      ``state, old, new``
                       ``FailureState`` (:mod:`.failure`), in the thread
                       that drove it
``FAILURE_SEEN``       recovering in place: the failure reached this      ``info`` (a :class:`~.recoveries.
                       rank's recovery                                    RecoveryInfo`)
``RECOVERY_STARTED``   recovering in place: the ranks agreed to recover   ``info``
``RECOVERED``          recovering in place: the group is re-formed, the   ``info``
                       training function is called again
=====================  ================================================  ===================================
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .log import first_line, log

SESSION_STARTED = "session started"
RANK_FAILED = "rank failed"
PEER_FAILED = "peer failed"
ACKNOWLEDGED = "failure acknowledged"
EXITING = "exiting"
RANK_KILLED = "rank killed"
RANK_ENDED = "rank ended"
JOB_FAILED = "job failed"
SESSION_CLOSED = "session closed"
FAILURE_SEEN = "failure seen"
RECOVERY_STARTED = "recovery started"
RECOVERED = "recovered"
FAILURE_PHASE = "failure phase"

EVENTS = (SESSION_STARTED, RANK_FAILED, PEER_FAILED, ACKNOWLEDGED, JOB_FAILED, EXITING, RANK_KILLED, RANK_ENDED,
          SESSION_CLOSED, FAILURE_SEEN, RECOVERY_STARTED, RECOVERED, FAILURE_PHASE)

_subscribers: dict[str, tuple[Callable[..., object], ...]] = {event: () for event in EVENTS}
_lock = threading.Lock()


def subscribe(event: str, callback: Callable[..., object]) -> None:
    """Call ``callback(*args)`` on every ``emit(event, *args)`` (once, however often subscribed)."""
    if event not in _subscribers:
        raise ValueError(f"unknown event {event!r}; the events are {', '.join(EVENTS)}")
    with _lock:
        if callback not in _subscribers[event]:
            _subscribers[event] = (*_subscribers[event], callback)  # replaced, never mutated: emit reads no lock


def unsubscribe(event: str, callback: Callable[..., object]) -> None:
    with _lock:
        _subscribers[event] = tuple(c for c in _subscribers[event] if c != callback)


def subscribers(event: str) -> tuple[Callable[..., object], ...]:
    return _subscribers[event]


def emit(event: str, *args: object) -> None:
    """Tell every subscriber of ``event``; never raises (a subscriber's error is logged)."""
    for callback in _subscribers[event]:
        try:
            callback(*args)
        except Exception as err:  # noqa: BLE001 - a report must never mask the failure it reports
            log(logging.WARNING, "%s: a subscriber (%s) failed: %s", event, getattr(callback, "__qualname__", callback),
                first_line(err))
