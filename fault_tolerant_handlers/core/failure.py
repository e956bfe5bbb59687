"""One failure state machine per attempt, and one tag on an exception.

"Has this job failed?" has one answer: the :class:`FailureState` of the session (one per process
group and attempt: :attr:`.session.Session.failure`). Everything that learns of a failure drives it
through a named transition; nothing else writes its fields:

* :meth:`~FailureState.failed_here`: this rank failed itself, its exception published
  (``Session.report_error``) or found hung by the watchdog (``told=False``). Returns whether it
  became the attempt's cause.
* :meth:`~FailureState.peer_failed`: the watchdog found a peer's failure
  (``Session.take_peer_failure``). Returns the incident to escalate, or ``None``.
* :meth:`~FailureState.signalled`: this rank's own SIGTERM/SIGINT is the cause
  (``launchers/signals.py``). Returns whether it was the first.
* :meth:`~FailureState.acknowledged`: the main thread takes a peer's failure and raises it
  (``Session.acknowledge``). Returns whether an incident was newly acknowledged.
* :meth:`~FailureState.agreement_ended`: an agreement ended (``Session.agree``); a fresh incident
  begins. Returns the incident it ended.
* :meth:`~FailureState.ended`: the attempt is over, recovered in place (``recover_in_place``) or
  ended (``Session.close``). Returns whether it was not over yet.

The **phase** is the attempt's, and the first failure wins (it is the :attr:`~FailureState.cause`;
later ones are kept in :attr:`~FailureState.others`)::

    RUNNING ──failed_here──> FAILED_HERE ─┐
       │ ───peer_failed───> PEER_FAILED ──┼──acknowledged──> ACKNOWLEDGED ──ended──> RECOVERED | ENDED
       └────signalled─────> SIGNALLED ────┘
    (any phase but RECOVERED and ENDED) ──ended──> RECOVERED | ENDED

An agreement that delivers a peer's failure this rank had not heard of moves RUNNING to
PEER_FAILED; ``acknowledged`` also leaves RUNNING (the main thread found a peer's failure itself,
``Session.classify``). Each change of phase is announced (:data:`.events.FAILURE_PHASE`).

The **incident** is narrower: what this process knows of the failure under way since the last
agreement (a peer's error, whether this rank failed itself, whether the main thread took it). An
agreement ends it (:meth:`~FailureState.agreement_ended`), so that a failure user code caught never
blinds the watchdog to the next one; :attr:`~FailureState.delivered` (a failure reached this rank's
main thread) stays.

The **tag** (:class:`Tag`, under one attribute, read with :func:`tag_of`, set with :func:`tag`) is
what the library learned of an exception object: the record this rank published for it, the
incident an agreement delivered it in, that it came out of an agreement, that an adapter handled
it, that Lightning's exception path was finished for it.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from . import events
from .errors import PeerFailedError
from .kinds import Ended, FailureKind

if TYPE_CHECKING:
    from .records import FailureRecord

#: How many later failures :attr:`FailureState.others` keeps (the first ones).
MAX_OTHERS = 16


class Phase(str, Enum):
    """Where an attempt stands (see the module's diagram)."""

    RUNNING = "running"
    FAILED_HERE = "failed here"
    PEER_FAILED = "peer failed"
    SIGNALLED = "signalled"
    ACKNOWLEDGED = "acknowledged"
    RECOVERED = "recovered"
    ENDED = "ended"

    __str__ = str.__str__
    __format__ = str.__format__


#: Phases no transition leaves.
FINAL = (Phase.RECOVERED, Phase.ENDED)


@dataclass
class Incident:
    """What this process knows of the failure under way since the last agreement. Written by its
    :class:`FailureState` only; read by anyone (the watchdog's escalation waits on ``acknowledged``).

    Attributes:
        peer_error: a peer's failure the watchdog found.
        local: this rank failed itself (its exception, a hang, its own signal).
        acknowledged: set when the main thread took the failure.
    """

    peer_error: PeerFailedError | None = None
    local: bool = False
    acknowledged: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Failure:
    """One failure as the state keeps it: data, never the exception object (its traceback would
    keep the frames of the attempt that raised it alive, its model and loaders with them).

    Attributes:
        kind: what happened (``RAISED`` for an exception).
        rank: the global rank that failed, when known.
        exc_type: the exception's type name, or the kind's name for a declared failure.
        message: the first line of its message (at most 300 characters).
        ended: how the rank's process ended, when known.
    """

    kind: FailureKind
    rank: int | None
    exc_type: str
    message: str
    ended: Ended | None = None

    @classmethod
    def of(cls, failure: object) -> Failure:
        """From a :class:`~.records.FailureRecord`, a :class:`~.errors.PeerFailedError` or any exception."""
        if isinstance(failure, Failure):
            return failure
        if isinstance(failure, PeerFailedError):
            return cls(failure.kind, failure.failed_rank, failure.exc_type, _line(failure.exc_message), failure.ended)
        if isinstance(failure, BaseException):
            return cls(FailureKind.RAISED, None, type(failure).__name__, _line(str(failure)))
        return cls(failure.kind, failure.rank, failure.exc_type, _line(failure.exc_message), failure.ended)


def _line(text: str) -> str:
    return (str(text).splitlines() or [""])[0][:300]


@dataclass(frozen=True)
class Verdict:
    """:meth:`FailureState.outcome`: the answer to "has this job failed?" at one moment."""

    phase: Phase
    failed: bool
    cause: Failure | None = None
    others: tuple[Failure, ...] = ()


class FailureState:
    """The failure state of one attempt on one process group. Thread-safe: transitions take a lock,
    queries are attribute reads (the adapters make two per batch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = Phase.RUNNING
        self._cause: Failure | None = None
        self._others: list[Failure] = []
        self._incident = Incident()
        self._escalated: list[Incident] = []  # incidents escalated, not yet acknowledged
        self._delivered = False
        self._signal: PeerFailedError | None = None

    # -- queries --------------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def cause(self) -> Failure | None:
        """The attempt's first failure (this rank's own, a peer's, its own signal), as data; ``None``: none."""
        return self._cause

    @property
    def others(self) -> tuple[Failure, ...]:
        """Failures learned after the cause, in order (at most :data:`MAX_OTHERS`)."""
        return tuple(self._others)

    @property
    def delivered(self) -> bool:
        """A failure reached this rank's main thread: its own (published), a failed agreement, its own signal."""
        return self._delivered

    @property
    def failing(self) -> bool:
        """**Has this job failed?** A failure was delivered, or the watchdog knows a peer's."""
        return self._delivered or self._incident.peer_error is not None

    @property
    def peer_error(self) -> PeerFailedError | None:
        """A peer's failure the watchdog found in the current incident (no communication)."""
        return self._incident.peer_error

    @property
    def local(self) -> bool:
        """This rank failed itself in the current incident."""
        return self._incident.local

    @property
    def signal(self) -> PeerFailedError | None:
        """This rank's own SIGTERM/SIGINT, when it is the job's cause: a collective broken after it
        is its consequence, not a peer's."""
        return self._signal

    @property
    def incident(self) -> Incident:
        """The current incident (read it; its fields are written here only)."""
        return self._incident

    def outcome(self) -> Verdict:
        with self._lock:
            return Verdict(self._phase, self.failing, self._cause, tuple(self._others))

    # -- transitions ----------------------------------------------------------------------------------
    def failed_here(self, cause: object, *, told: bool = True) -> bool:
        """This rank failed itself: ``cause`` is its record (or error). ``told``: its main thread
        knows (it raised); ``False`` for a hang the watchdog found (the main thread is interrupted).
        Returns whether it became the attempt's cause."""
        with self._lock:
            self._incident.local = True
            if told:
                self._delivered = True
            old, first = self._phase, self._note(cause)
            if first:
                self._phase = Phase.FAILED_HERE
        return self._announce(old)

    def peer_failed(self, err: PeerFailedError) -> Incident | None:
        """The watchdog found a peer's failure: the incident to escalate (release this rank's
        collectives, tell the main thread), or ``None`` when there is nothing to do (already known
        in this incident, this rank's own signal is the cause, or this rank failed itself)."""
        with self._lock:
            incident, old = self._incident, self._phase
            if incident.peer_error is not None or self._signal is not None:
                self._note(err, known=True)
                escalated = None
            else:
                incident.peer_error = err
                escalated = None if incident.local else incident
                if escalated is not None:
                    self._escalated.append(incident)
                if self._note(err):
                    self._phase = Phase.PEER_FAILED
        self._announce(old)
        return escalated

    def signalled(self, cause: PeerFailedError) -> bool:
        """This rank's own SIGTERM/SIGINT is the job's cause (``cause``: its ``RankSignalled``).
        Returns whether it was the first."""
        with self._lock:
            if self._signal is not None:
                return False
            self._signal = cause
            self._incident.local = True  # the peers' reaction is not a failure to escalate here
            self._delivered = True  # the job fails: its exit does not wait on a store that may be leaving
            old = self._phase
            if self._note(cause):
                self._phase = Phase.SIGNALLED
        self._announce(old)
        return True

    def acknowledged(self, err: BaseException | None = None) -> bool:
        """The main thread takes a peer's failure (``err``) and raises it: the incident ``err`` was
        delivered in (its tag), else the current one, and every escalated one, are acknowledged (no
        reported exit by the watchdog). Returns whether one was not acknowledged yet. Any phase but
        the final ones becomes ACKNOWLEDGED."""
        taken = tag_of(err).incident if err is not None else None
        with self._lock:
            incidents = (taken or self._incident, *self._escalated)
            applied = any(not i.acknowledged.is_set() for i in incidents)
            for incident in incidents:
                incident.acknowledged.set()
            self._escalated.clear()
            old = self._phase
            if err is not None:
                self._note(err)
            if old not in FINAL:
                self._phase = Phase.ACKNOWLEDGED
        self._announce(old)
        return applied

    def agreement_ended(self, failed: bool, error: BaseException | None = None) -> Incident:
        """An agreement ended (``failed``: some rank failed; ``error``: what this rank raises for a
        peer's failure or a mismatch). A fresh incident begins; returns the one that ended."""
        with self._lock:
            ended, old = self._incident, self._phase
            self._delivered = self._delivered or failed
            if failed and isinstance(error, PeerFailedError) and self._note(error):
                self._phase = Phase.PEER_FAILED
            self._incident = Incident()
        self._announce(old)
        return ended

    def ended(self, *, recovered: bool) -> bool:
        """The attempt is over: ``recovered`` in place, or ended. Returns whether it was not over yet."""
        with self._lock:
            old = self._phase
            if old in FINAL:
                return False
            self._phase = Phase.RECOVERED if recovered else Phase.ENDED
        self._announce(old)
        return True

    # -- helpers (under the lock) ---------------------------------------------------------------------
    def _note(self, failure: object, *, known: bool = False) -> bool:
        """Keep ``failure`` (as a :class:`Failure`): the cause when there is none yet and the phase is
        not final (returns True); the same failure seen again is not kept twice."""
        if failure is None:
            return False
        failure = Failure.of(failure)
        if failure == self._cause or failure in self._others:
            return False
        if self._cause is None and not known and self._phase not in FINAL:
            self._cause = failure
            return True
        if len(self._others) < MAX_OTHERS:
            self._others.append(failure)
        return False

    def _announce(self, old: Phase) -> bool:
        new = self._phase
        if new is not old:
            events.emit(events.FAILURE_PHASE, self, old, new)
            return True
        return False


# -- the tag ----------------------------------------------------------------------------------------
#: The one attribute the library sets on an exception object.
TAG_ATTR = "_fth_failure"


@dataclass(frozen=True)
class Tag:
    """What the library learned of one exception object.

    Attributes:
        record: this rank published it: its record (never published twice).
        incident: an agreement delivered it: the :class:`Incident` it belongs to (what
            :meth:`FailureState.acknowledged` marks, not the fresh one that replaced it).
        agreed: it came out of an agreement: every rank of that agreement raises, so an enclosing
            section lets it through without agreeing again.
        handled: an adapter handled it (published, or converted to a peer's error).
        taken: an adapter finished its framework's exception path for it (a Lightning callback, an
            Ignite ``EXCEPTION_RAISED`` handler).
        raised_as: what an adapter raised for it (itself, or the peer's error it became): an
            engine that hands the same exception, or the raised one, to the adapter again gets it.
    """

    record: FailureRecord | None = None
    incident: Incident | None = None
    agreed: bool = False
    handled: bool = False
    taken: bool = False
    raised_as: BaseException | None = None


_UNTAGGED = Tag()


def tag_of(exc: BaseException | None) -> Tag:
    """The tag of ``exc`` (an empty one when it has none)."""
    found = getattr(exc, TAG_ATTR, None) if exc is not None else None
    return found if isinstance(found, Tag) else _UNTAGGED


def tag(exc: BaseException, **learned: object) -> None:
    """Add what was ``learned`` (:class:`Tag`'s fields) to the tag of ``exc``, where its type allows."""
    new = dataclasses.replace(tag_of(exc), **learned)  # a field that does not exist raises here
    try:
        setattr(exc, TAG_ATTR, new)
    except Exception:  # noqa: BLE001 - some exception types refuse attributes
        pass
