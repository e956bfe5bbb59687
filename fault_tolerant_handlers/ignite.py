"""PyTorch-Ignite adapter: ``FaultTolerance().attach(trainer)``.

Maps Ignite events onto the verbs of :class:`~fault_tolerant_handlers.adapters.guard.Guard`:

========================  ==========================================================================
``STARTED``               start (collective: side group, watchdog reference); a DDP's bucket layout
                          goes into each ``Checkpoint``'s ``to_save`` (:mod:`.adapters.resume_ignite`)
``ITERATION_COMPLETED``   heartbeat; every ``sync_every`` iterations, one agreement; between them, a
                          peer's failure the watchdog knows is raised (an attribute read);
                          recovering in place, the last handler, after live state's mark
``EPOCH_STARTED``         (``hang_timeout="auto"``) training steps begin
``EPOCH_COMPLETED``       agreement, *before* the other epoch-end handlers (evaluation, checkpoint);
                          (``"auto"``) what follows is judged as an evaluation
``COMPLETED``             agreement, then the watchdog reference is dropped
``EXCEPTION_RAISED``      record and release (local failure) or convert to ``PeerFailedError``
                          (decided as Ignite logs the exception, so that the library's line naming
                          the failing rank comes first); runs the engine's other exception handlers,
                          then **re-raises** (with distribution; without, Ignite's own rule applies)
``ITERATION_STARTED``,    recovering in place only: live state's bookkeeping (the first and the
``ITERATION_COMPLETED``   last handler but the agreement) and its capture at ``EXCEPTION_RAISED``
                          (:mod:`.adapters.live_ignite`)
``FaultToleranceEvents``  registered on the engine: a recovery in place's ``FAILURE_SEEN``,
                          ``RECOVERY_STARTED`` (on the failed attempt's engine) and ``RECOVERED``
                          (on the next one's, at ``STARTED``); ``engine.state.fault_tolerance``
                          holds the numbers (:mod:`.adapters.recovery_ignite`)
========================  ==========================================================================

Ignite stops re-raising once any ``EXCEPTION_RAISED`` handler is attached (``Engine._handle_exception``)
and, for an exception in the process function, even goes on to the next epoch. In a distributed run
this handler always re-raises, so the run can never silently continue. Importing this module makes
Ignite's ``Checkpoint.load_objects`` give a DDP the bucket layout saved beside it (process-wide: the
load often comes before ``attach``). Private Ignite API: see :mod:`.adapters.compat_ignite`.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Mapping

from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint

from .adapters import compat_ignite as _compat_ignite
from .adapters.live_ignite import IgniteLive
from .adapters.recovery_ignite import FaultToleranceEvents, IgniteRecovery
from .core import attempts
from .core.failure import tag, tag_of
from .core.log import log
from .detect.autohang import EVALUATION, STEP
from .adapters.resume_ignite import (DCPSaver, SafeDiskSaver, add_bucket_layouts, check_mid_epoch_resume,
                                     hook_load_objects)
from .adapters.guard import Guard
from .core.inject import Injector

__all__ = ["DCPSaver", "FaultTolerance", "FaultToleranceEvents", "SafeDiskSaver"]

hook_load_objects()  # Checkpoint.load_objects gives a DDP its checkpoint's bucket layout (adapters.resume_ignite)


class FaultTolerance:
    """Make an Ignite run fail together: attach on every rank, in one line.

    An exception on one rank anywhere in the run (process function, data, another handler, a
    handler that runs on rank 0 only, an evaluator run from a trainer handler) makes ``Engine.run``
    raise on **every** rank within about a second: the failing rank its own exception, the others
    :class:`~fault_tolerant_handlers.PeerFailedError` with the failing rank, exception, message,
    traceback, iteration and epoch. Ranks blocked in a DDP all_reduce with the failing rank are
    released at once. Without distribution it does nothing: an exception is handled exactly as
    stock Ignite handles it (re-raised, unless your own ``EXCEPTION_RAISED`` handler takes it).

    Args:
        sync_every: iterations between agreements within an epoch (default 100; ``None``: epoch
            ends and the end of the run only). Each agreement is one small all_reduce on a gloo side
            group (~0.8 ms at 2 ranks); the watchdog covers the iterations in between.
        hang_timeout: opt-in; a duration (a ``timedelta``, a number of seconds, a
            ``"DD:HH:MM:SS"`` string or a dict such as ``{"minutes": 5}``, from 1 s to 7 days): a
            rank whose loop makes no progress for this long is declared hung and every rank ends
            with its stack. ``"auto"``: the deadline is learned per kind of work (iterations; the
            epoch-end handlers and any evaluator ``Engine`` run from a trainer's handler, as
            evaluations; checkpoint writes), see docs/hang-detection.md. ``None``: off (env
            ``FTH_HANG_TIMEOUT_SEC``, seconds or ``auto``).
        watchdog: start the out-of-band watchdog (default True).
        name: the loop's name in reports (a non-empty str).

    Raises:
        ValueError: ``sync_every`` is not a positive int or ``None``; ``hang_timeout`` is a duration
            outside 1 s to 7 days; an ``FTH_*`` environment variable is out of its range.
        TypeError: ``hang_timeout`` is none of its accepted forms; ``watchdog`` is not a bool;
            ``name`` is not a non-empty str.

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers.ignite import FaultTolerance

            trainer = create_supervised_trainer(model, optimizer, loss_fn)
            FaultTolerance().attach(trainer)       # on every rank
            trainer.run(train_loader, max_epochs=5)

    .. warning::
        Attach it on **every** rank. Wrong: ``if idist.get_rank() == 0: FaultTolerance().attach(trainer)``
        (the other ranks would wait in the agreement). Correct: attach unconditionally.
    """

    def __init__(self, sync_every: int | None = 100, hang_timeout: timedelta | float | str | dict | None = None,
                 watchdog: bool = True, name: str = "train") -> None:
        self.guard = Guard(sync_every=sync_every, hang_timeout=hang_timeout, watchdog=watchdog, name=name)
        self._injector = Injector.from_env()  # FTH_INJECT: rehearse a failure without editing the job
        self._engine: Engine | None = None
        self._live: IgniteLive | None = None  # recovering in place: the trainer's live state (data.live)
        self._recovery = IgniteRecovery()  # FaultToleranceEvents, engine.state.fault_tolerance
        self._cause_first: Any = None  # a filter on engine.logger while the run runs (_decide)

    def attach(self, engine: Engine) -> FaultTolerance:
        """Register every event this handler needs on ``engine`` and return ``self``; also registers
        :class:`FaultToleranceEvents` (a recovery in place's moments) and sets
        ``engine.state.fault_tolerance`` (:class:`~fault_tolerant_handlers.RecoveryMetrics`)."""
        if not isinstance(engine, Engine):
            raise TypeError(f"attach(engine=...) takes an ignite.engine.Engine, got {type(engine).__name__}")
        _compat_ignite.check(engine)
        self._engine = engine
        self._cause_first = _compat_ignite.before_error_log(engine, lambda exc: self._decide(engine, exc))
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        self._recovery.attach(engine)
        if attempts.recovering():
            self._live = IgniteLive()
            self._live.attach(engine)
            engine.add_event_handler(Events.STARTED, self._after_live_started)
        if self._injector is not None:
            engine.add_event_handler(Events.ITERATION_STARTED, self._inject)
        _compat_ignite.prepend(engine, Events.EPOCH_COMPLETED, self._epoch_completed)
        _compat_ignite.prepend(engine, Events.COMPLETED, self._completed)
        _compat_ignite.prepend(engine, Events.EXCEPTION_RAISED, self._exception_raised)
        return self

    def __call__(self, engine: Engine) -> None:
        """The agreement of a sync point: usable as a handler on any event."""
        self.guard.sync("a sync point", step=engine.state.iteration, epoch=engine.state.epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.guard.load_state_dict(state_dict)

    # -- events -------------------------------------------------------------------------------------
    def _started(self, engine: Engine) -> None:
        engine.logger.addFilter(self._cause_first)  # the logger the run logs with (a script may set its own)
        self.guard.start()
        self.guard.beat(engine.state.iteration, "start")
        if self.guard.auto_hang is not None:
            _compat_ignite.check_running_engines()
            self.guard.explain_with(self._nested_engine)
        if self.guard.session is not None:  # without distribution it does nothing (docs/ignite.md)
            check_mid_epoch_resume(engine)  # a mid-epoch resume whose loader would start the epoch over
        # the DDP's bucket layout beside the model in every Checkpoint's to_save (a resume exact at 3+ ranks)
        add_bucket_layouts(engine, [h for h in _compat_ignite.attached_handlers(engine) if isinstance(h, Checkpoint)])

    def _after_live_started(self, engine: Engine) -> None:
        """Recovering in place: a peer's failure is raised at the end of an iteration only after live
        state marked it completed (its last handler), so that a survivor that completed the optimizer
        step of that iteration holds its live state whenever the failure reaches it."""
        _compat_ignite.append_last(engine, Events.ITERATION_COMPLETED, self._iteration_completed)

    def _inject(self, engine: Engine) -> None:
        self._injector.maybe_fire(self.guard.rank, engine.state.iteration, engine.state.epoch, engine.state.dataloader)

    def _epoch_started(self, engine: Engine) -> None:
        self.guard.beat(engine.state.iteration, STEP)

    def _nested_engine(self, frame) -> tuple[str, object] | None:
        """``hang_timeout="auto"``, on the watchdog thread: an evaluator ``Engine`` running inside
        this trainer's run (from any of its handlers) is an evaluation; its iteration is progress."""
        engines = _compat_ignite.running_engines(frame)
        if len(engines) >= 2 and engines[0] is not self._engine and any(e is self._engine for e in engines[1:]):
            inner = engines[0]
            return EVALUATION, (id(inner), inner.state.epoch, inner.state.iteration)
        return None

    def _iteration_completed(self, engine: Engine) -> None:
        iteration = engine.state.iteration
        self._recovery.completed = iteration
        self.guard.beat(iteration, STEP, completed=True)
        if self.guard.due(iteration):
            self.guard.sync("iteration", step=iteration, epoch=engine.state.epoch)
        else:  # an attribute read: a peer's failure the watchdog knows, which a step that swallows
            self.guard.check(step=iteration, epoch=engine.state.epoch)  # every error did not raise


    def _epoch_completed(self, engine: Engine) -> None:
        restarts = getattr(engine.state.dataloader, "restart_count", None)
        if restarts is not None:  # a RestartableDataLoader: its worker restarts so far
            engine.state.dataloader_restarts = restarts
        self.guard.sync("epoch end", step=engine.state.iteration, epoch=engine.state.epoch)
        self.guard.beat(engine.state.iteration, EVALUATION)  # the other epoch-end handlers

    def _completed(self, engine: Engine) -> None:
        self.guard.sync("end of run", step=engine.state.iteration, epoch=engine.state.epoch)
        self.guard.stop()
        engine.logger.removeFilter(self._cause_first)

    def _decide(self, engine: Engine, exc: BaseException) -> BaseException:
        """What this rank raises for ``exc``, decided once: Ignite logs the exception ("Current run is
        terminating due to exception") before it fires ``EXCEPTION_RAISED``; deciding then
        (:func:`~.adapters.compat_ignite.before_error_log`) puts the library's line, naming the failing
        rank and its cause, first."""
        decided = tag_of(exc).raised_as
        if decided is None and self.guard.session is not None:
            decided = self.guard.on_exception(exc, step=engine.state.iteration, epoch=engine.state.epoch)
            tag(exc, raised_as=decided)
            tag(decided, raised_as=decided)
        return decided if decided is not None else exc

    def _exception_raised(self, engine: Engine, exc: BaseException) -> None:
        # -- without distribution: exactly stock Ignite (docs/ignite.md, "Without distribution") --
        if self.guard.session is None:
            if any(getattr(e[0], "__self__", None) is not self
                   for e in _compat_ignite.handlers_of(engine, Events.EXCEPTION_RAISED)):
                return  # the user's handlers run next and decide, as without this handler
            raise exc  # no other handler: Ignite itself would have raised it
        # -- with distribution --
        to_raise = self._decide(engine, exc)
        if tag_of(exc).taken:
            raise to_raise  # Ignite's outer loop handing us the same exception (or the one raised for it) again
        tag(exc, taken=True)
        tag(to_raise, taken=True)
        engine.logger.removeFilter(self._cause_first)
        if self._live is not None:  # the peers told first; then, before the other handlers run, the state
            self._live.failed()
        self._recovery.failed()
        # Run the engine's other exception handlers ourselves: an error in one of them (a
        # collective that fails now that peers are gone) is logged, never allowed to mask the cause.
        for entry in list(_compat_ignite.handlers_of(engine, Events.EXCEPTION_RAISED)):
            if getattr(entry[0], "__self__", None) is self:
                continue
            try:
                _compat_ignite.call_handler(engine, entry, (exc,))
            except BaseException as err:  # noqa: BLE001
                if err is exc:
                    continue
                log(logging.WARNING, "an EXCEPTION_RAISED handler failed: %s: %s", type(err).__name__, err,
                    step=engine.state.iteration)
        raise to_raise
