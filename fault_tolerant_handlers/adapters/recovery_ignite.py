"""Ignite: a recovery in place's moments (:mod:`..core.recoveries`) as events of the engine.

:class:`~fault_tolerant_handlers.ignite.FaultTolerance` registers :class:`FaultToleranceEvents` on the
engine it is attached to and keeps :class:`~..core.recoveries.RecoveryMetrics` on
``engine.state.fault_tolerance`` (its ``last`` is the :class:`~..core.recoveries.RecoveryInfo` of the
event being fired). When they fire:

* ``FAILURE_SEEN``, ``RECOVERY_STARTED``: on the failed attempt's engines (those attached in it, still
  alive), while the recovery runs: the run has ended, the handlers run in the recovering thread,
  and an exception they raise is logged, never passed on;
* ``RECOVERED``: on the next attempt's engine, at its ``STARTED`` (the engine that recovered did not
  exist while the group was re-formed), once the checkpoint or live state is loaded: the step it
  carries on from is its iteration.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from ignite.engine import Engine, EventEnum, Events

from ..core import attempts, hooks, recoveries
from ..core.log import log


class FaultToleranceEvents(EventEnum):
    """A recovery in place, as Ignite events (registered by ``FaultTolerance().attach(engine)``).

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers.ignite import FaultTolerance, FaultToleranceEvents

            FaultTolerance().attach(trainer)

            @trainer.on(FaultToleranceEvents.RECOVERED)
            def recovered(engine):
                info = engine.state.fault_tolerance.last  # a RecoveryInfo
                print(info.cause.rank, info.attempt, info.step, info.source, info.seconds)
    """

    FAILURE_SEEN = "fault_tolerance_failure_seen"
    RECOVERY_STARTED = "fault_tolerance_recovery_started"
    RECOVERED = "fault_tolerance_recovered"


#: The engines FaultTolerance is attached to, with the recovery attempt they were attached in.
_engines: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()
#: The failed attempt's last completed iteration (set at its EXCEPTION_RAISED).
_last_completed: int | None = None


class IgniteRecovery:
    """One ``FaultTolerance``'s part: the events on its engine, and its iterations completed."""

    def __init__(self) -> None:
        self.completed: int | None = None

    def attach(self, engine: Engine) -> None:
        missing = [e for e in FaultToleranceEvents if not engine.has_registered_events(e)]
        if missing:
            engine.register_events(*missing)
        engine.state.fault_tolerance = recoveries.metrics()
        _engines[engine] = attempts.in_place()
        engine.add_event_handler(Events.STARTED, self._started)

    def _started(self, engine: Engine) -> None:
        global _last_completed
        info = recoveries.carried_on(engine.state.iteration, _last_completed)
        engine.state.fault_tolerance = recoveries.metrics()
        if info is not None:
            _last_completed = None
            engine.fire_event(FaultToleranceEvents.RECOVERED)

    def failed(self) -> None:
        """``EXCEPTION_RAISED``: what this loop completed is what the next attempt may compute twice."""
        global _last_completed
        _last_completed = self.completed


def _fire(event: FaultToleranceEvents):
    def fire(info: recoveries.RecoveryInfo) -> None:
        for engine, attempt in list(_engines.items()):
            if attempt != info.attempt - 1:  # only the failed attempt's engines
                continue
            engine.state.fault_tolerance = recoveries.metrics()
            try:
                engine.fire_event(event)
            except Exception as err:  # noqa: BLE001 - a handler must not stop the recovery (nor the others)
                log(logging.WARNING, "a %s handler failed: %s: %s", event.name, type(err).__name__,
                    (str(err).splitlines() or [""])[0][:200])
    fire.__qualname__ = f"ignite {event.name}"
    return fire


hooks.add(hooks.FAILURE_SEEN, _fire(FaultToleranceEvents.FAILURE_SEEN))
hooks.add(hooks.RECOVERY_STARTED, _fire(FaultToleranceEvents.RECOVERY_STARTED))
