"""Recovery made visible (``docs/recovering.md``, "Seeing a recovery"): each moment of a recovery in
place (:class:`RecoveryPhase`) is announced through :mod:`.hooks` with one frozen :class:`RecoveryInfo`,
kept in :func:`recovery_history`, told to :func:`on_recovery`'s subscribers and summed up by
:func:`metrics`; the adapters translate them into Ignite events and Lightning hooks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

from . import hooks
from .failure import FailureRecord


class RecoveryPhase(str, Enum):
    """The moment of a recovery a :class:`RecoveryInfo` tells of (its value: the hook it is announced at)."""

    #: The failure reached this rank's recovery (its cause as this rank sees it); no decision yet.
    FAILURE_SEEN = hooks.FAILURE_SEEN
    #: The ranks agreed to recover: the agreed cause, and where the next attempt's state comes from.
    RECOVERY_STARTED = hooks.RECOVERY_STARTED
    #: The process group is re-formed: the training function is called again.
    RECOVERED = hooks.RECOVERED

    __str__ = str.__str__
    __format__ = str.__format__


#: ``RecoveryInfo.source``: the next attempt carries on from the ranks' live state (no step twice).
LIVE = "live"
#: ``RecoveryInfo.source``: the next attempt resumes from the newest checkpoint.
CHECKPOINT = "checkpoint"


#: What failed, as a recovery tells it (:attr:`RecoveryInfo.cause`): the one failure value,
#: :class:`~.failure.FailureRecord`. Read ``rank``, ``kind``, ``exc_type``, ``message`` (capped),
#: ``step``, ``where`` (the section, or ``""``), ``own`` (the rank that tells it failed itself) and
#: ``not_in_place`` (why it cannot be recovered in place, ``""`` when it can).
RecoveryCause = FailureRecord


@dataclass(frozen=True)
class RecoveryInfo:
    """One moment of one recovery in place, on one rank (``docs/recovering.md`` has the table).

    Attributes:
        phase: a :class:`RecoveryPhase`.
        attempt: the recovery's number in this process (1 for the first: what ``recovery_attempt()`` returns next).
        rank: the rank that tells it (this process's).
        cause: the :class:`RecoveryCause`: this rank's view at ``FAILURE_SEEN``, then the agreed one.
        seconds: since the failure reached this rank's recovery (0, the agreement, the whole recovery).
        source: ``"live"`` (the ranks' live state), ``"checkpoint"``, or ``None`` (not decided yet).
        step: the step the next attempt carries on from (Ignite: iteration; Lightning: global step); from
            a checkpoint, ``None`` until the next attempt's loop started.
        steps_computed_twice: steps this rank computes again (0 from live state), or ``None`` until the
            next attempt's loop started.
    """

    phase: RecoveryPhase
    attempt: int
    rank: int
    cause: FailureRecord
    seconds: float = 0.0
    source: str | None = None
    step: int | None = None
    steps_computed_twice: int | None = None

    @property
    def live(self) -> bool:
        return self.source == LIVE

    def describe(self) -> str:
        state = {None: "", LIVE: ", from live state", CHECKPOINT: ", from the newest checkpoint"}[self.source]
        at = f" at step {self.step}" if self.step is not None else ""
        return f"[rank {self.rank}] {self.phase}, attempt {self.attempt}{state}{at}, {self.seconds:.2f} s: " \
               f"{self.cause.describe()}"


@dataclass
class RecoveryMetrics:
    """The recoveries in place of this process so far (Ignite: ``engine.state.fault_tolerance``).

    Attributes:
        recoveries: recoveries in place completed (``RECOVERED``).
        time_to_recover: the last recovery's ``seconds`` (failure to re-formed group), or ``None``.
        total_time_to_recover: the sum over the recoveries (seconds).
        steps_computed_twice: the last recovery's (0 from live state), or ``None`` (not known yet).
        total_steps_computed_twice: the sum over the recoveries whose count is known.
        last: the last :class:`RecoveryInfo` of any phase, or ``None``.
    """

    recoveries: int = 0
    time_to_recover: float | None = None
    total_time_to_recover: float = 0.0
    steps_computed_twice: int | None = None
    total_steps_computed_twice: int = 0
    last: RecoveryInfo | None = None

    def as_dict(self, prefix: str = "fault_tolerance/") -> dict[str, float]:
        """The numbers, as a logger takes them (``None`` left out)."""
        values = {"recoveries": self.recoveries, "time_to_recover": self.time_to_recover,
                  "steps_computed_twice": self.steps_computed_twice}
        return {f"{prefix}{k}": float(v) for k, v in values.items() if v is not None}


# -- this process's history ---------------------------------------------------------------------------
_lock = threading.Lock()
_history: list[RecoveryInfo] = []
_carried: set[int] = set()  # the recoveries whose next loop started (carried_on)


def recovery_history() -> tuple[RecoveryInfo, ...]:
    """Every :class:`RecoveryInfo` this process told since its recovery in place started, oldest
    first (three per recovery). Under torchrun with the keeper, the training runs in the keeper's
    child: ask there (in the training function or a handler)."""
    return tuple(_history)


def metrics() -> RecoveryMetrics:
    done = [i for i in _history if i.phase is RecoveryPhase.RECOVERED]
    last = done[-1] if done else None
    return RecoveryMetrics(
        recoveries=len(done),
        time_to_recover=last.seconds if last else None,
        total_time_to_recover=sum(i.seconds for i in done),
        steps_computed_twice=last.steps_computed_twice if last else None,
        total_steps_computed_twice=sum(i.steps_computed_twice or 0 for i in done),
        last=_history[-1] if _history else None)


def forget() -> None:
    """A new recovery in place starts in this process: the history of the one before goes."""
    with _lock:
        _history.clear()
        _carried.clear()


def _record(info: RecoveryInfo) -> None:
    with _lock:
        _history.append(info)


def announce(info: RecoveryInfo) -> None:
    """Record ``info`` and tell its event's subscribers (never raises)."""
    hooks.emit(info.phase.value, info)


def carried_on(step: int, last_completed: int | None) -> RecoveryInfo | None:
    """The adapters, as the first loop after a recovery starts at ``step`` (this rank had completed
    ``last_completed`` before the failure): the last ``RECOVERED`` with the step carried on from and
    the steps computed twice filled in, or ``None`` when no recovery waits for its loop."""
    with _lock:
        i = next((i for i in reversed(range(len(_history))) if _history[i].phase is RecoveryPhase.RECOVERED), None)
        if i is None or _history[i].attempt in _carried:
            return None  # none, or delivered already: a second loop (an evaluator, another run) is not the one resumed
        info = _history[i]
        _carried.add(info.attempt)
        start = info.step if info.live and info.step is not None else step
        twice = max(0, last_completed - start) if last_completed is not None else 0 if info.live else None
        _history[i] = info = replace(info, step=start, steps_computed_twice=twice)
        return info


def on_recovery(callback: Callable[[RecoveryInfo], object]) -> Callable[[], None]:
    """Call ``callback(info)`` at every moment of every recovery in place in this process (each
    :class:`RecoveryPhase`), in the recovering thread; an exception it raises is logged, never passed
    on. Returns a function that unsubscribes it.

    Raises:
        TypeError: ``callback`` is not callable.

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers import on_recovery

            stop = on_recovery(lambda info: print(info.describe()))
    """
    if not callable(callback):
        raise TypeError(f"on_recovery(callback): callback must be a callable taking a RecoveryInfo, got {callback!r}")
    for phase in RecoveryPhase:
        hooks.add(phase.value, callback)

    def unsubscribe() -> None:
        for phase in RecoveryPhase:
            hooks.remove(phase.value, callback)

    return unsubscribe
