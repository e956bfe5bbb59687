"""PyTorch-Ignite adapter: ``FaultTolerance().attach(trainer)`` maps Ignite's events onto a
:class:`~.core.session.Guard` (docs/ignite.md); Ignite's private API is in :mod:`.adapters.compat_ignite`.
Importing it makes ``Checkpoint.load_objects`` give a DDP the bucket layout saved beside it."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from ignite.engine import Engine, EventEnum, Events
from ignite.handlers import Checkpoint, DiskSaver
from ignite.handlers.checkpoint import BaseSaveHandler
from torch.nn.parallel import DistributedDataParallel

from .adapters import LiveLoop, LoopRecovery, compat_ignite as _compat_ignite
from .core import attempts, interrupts, recoveries, sharded
from .core.failure import tag, tag_of
from .core.hooks import log
from .core.inject import Injector
from .core.session import Guard
from .data import dcp, live, snapshots
from .data.dcp import ShardedState
from .data.ddp_buckets import DDPBucketLayout
from .data.loader import RestartableDataLoader
from .detect.autohang import EVALUATION, START, STEP

__all__ = ["DCPSaver", "FaultTolerance", "FaultToleranceEvents", "SafeDiskSaver"]


class FaultTolerance:
    """Make an Ignite run fail together: an exception on one rank makes ``Engine.run`` raise on every
    rank within about a second, the others :class:`~fault_tolerant_handlers.PeerFailedError` naming it
    (docs/ignite.md). Without distribution it changes nothing.

    Args: ``sync_every`` (iterations between agreements, ``None``: epoch ends only), ``hang_timeout``,
    ``watchdog``, ``name``: docs/reference.md, "Adapter arguments".

    Raises:
        ValueError, TypeError: an argument or an ``FTH_*`` variable out of its range, naming it.

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers.ignite import FaultTolerance

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
        self._run_codes: frozenset = frozenset()  # the engine's functions that log an exception it caught
        self._ignite_handles: Callable[[BaseException], None] | None = None  # the engine's own _handle_exception

    def attach(self, engine: Engine) -> FaultTolerance:
        """Register every event this handler needs on ``engine`` (and :class:`FaultToleranceEvents`); return ``self``."""
        if not isinstance(engine, Engine):
            raise TypeError(f"attach(engine=...) takes an ignite.engine.Engine, got {type(engine).__name__}")
        _compat_ignite.check(engine)
        self._engine = engine
        self._run_codes = _compat_ignite.run_codes()
        self._ignite_handles = _compat_ignite.handle_exceptions(engine, self._handle_exception)
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.EPOCH_STARTED, lambda e: self.guard.beat(e.state.iteration, STEP))
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        self._recovery.attach(engine)
        if attempts.recovering():
            self._live = IgniteLive()
            self._live.attach(engine)
            # a peer's failure raised only after live state's mark
            engine.add_event_handler(Events.STARTED, lambda e: _compat_ignite.append_last(
                e, Events.ITERATION_COMPLETED, self._iteration_completed))
        if self._injector is not None:
            engine.add_event_handler(Events.ITERATION_STARTED, self._inject)
        _compat_ignite.prepend(engine, Events.EPOCH_COMPLETED, self._epoch_completed)
        _compat_ignite.prepend(engine, Events.COMPLETED, self._completed)
        return self

    def __call__(self, engine: Engine) -> None:
        """The agreement of a sync point: usable as a handler on any event."""
        self.guard.sync("a sync point", step=engine.state.iteration, epoch=engine.state.epoch)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict(state_dict=...) takes a mapping, got {type(state_dict).__name__}")

    # -- events -------------------------------------------------------------------------------------
    def _started(self, engine: Engine) -> None:
        engine.logger.addFilter(self._cause_first)  # the logger the run logs with (a script may set its own)
        self.guard.start()
        self.guard.beat(engine.state.iteration, START)
        if self.guard.auto_hang is not None:
            _compat_ignite.check_running_engines()
            self.guard.explain_with(self._nested_engine)
        if self.guard.session is not None:  # without distribution it does nothing (docs/ignite.md)
            check_mid_epoch_resume(engine)  # a mid-epoch resume whose loader would start the epoch over
        # the DDP's bucket layout beside the model in every Checkpoint's to_save (a resume exact at 3+ ranks)
        add_bucket_layouts(engine, [h for h in _compat_ignite.attached_handlers(engine) if isinstance(h, Checkpoint)])

    def _inject(self, engine: Engine) -> None:
        rank = self.guard.session.rank if self.guard.session is not None else 0
        self._injector.maybe_fire(rank, engine.state.iteration, engine.state.epoch, engine.state.dataloader)

    def _nested_engine(self, frame) -> tuple[str, object] | None:
        """``hang_timeout="auto"``: an evaluator ``Engine`` running inside this trainer's run is an evaluation."""
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
        else:  # an attribute read: a peer's failure the watchdog knows
            self.guard.check(step=iteration, epoch=engine.state.epoch)

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
        """What this rank raises for ``exc``, decided once."""
        decided = tag_of(exc).raised_as
        if decided is None and self.guard.session is not None:
            decided = self.guard.on_exception(exc, step=engine.state.iteration, epoch=engine.state.epoch)
            tag(exc, raised_as=decided)
            tag(decided, raised_as=decided)
        return decided if decided is not None else exc

    def _cause_first(self, record: logging.LogRecord) -> bool:
        """A filter on ``engine.logger``: the engine's run loop logs the exception it caught (the frame
        of its traceback's first entry) and hands it to ``_handle_exception``: decide first, our line first."""
        exc = sys.exc_info()[1] if record.levelno >= logging.ERROR else None
        frame = exc.__traceback__.tb_frame if exc is not None and exc.__traceback__ is not None else None
        if frame is not None and frame.f_code in self._run_codes and frame.f_locals.get("self") is self._engine:
            try:
                self._decide(self._engine, exc)
            except Exception:  # noqa: BLE001 - _handle_exception decides again and raises it
                pass
        return True

    def _handle_exception(self, exc: BaseException) -> None:
        """The engine's ``_handle_exception``: decide, capture the live state, then the engine's
        ``EXCEPTION_RAISED`` handlers as Ignite runs them (an error in one is logged, never masks the
        cause), then raise. Without distribution: exactly stock Ignite."""
        if self.guard.session is None:
            return self._ignite_handles(exc)
        engine = self._engine
        to_raise = self._decide(engine, exc)
        if tag_of(exc).taken:
            raise to_raise  # Ignite's outer loop handing us the same exception (or the one raised for it) again
        engine.logger.removeFilter(self._cause_first)
        if self._live is not None:  # the peers told first; then the state, before the other handlers run
            self._live.failed()
        IgniteRecovery.last_completed = self._recovery.completed  # what the next attempt may compute twice
        try:
            self._ignite_handles(exc)  # raises exc when no EXCEPTION_RAISED handler is attached
        except BaseException as err:  # noqa: BLE001
            if err is not exc and err is not to_raise:
                log(logging.WARNING, "an EXCEPTION_RAISED handler failed: %s: %s", type(err).__name__, err,
                    step=engine.state.iteration)
        tag(exc, taken=True)
        tag(to_raise, taken=True)
        raise to_raise


# -- a recovery in place's moments, as events of the engine ----------------------------------------
class FaultToleranceEvents(EventEnum):
    """A recovery in place, as Ignite events (registered by ``FaultTolerance().attach(engine)``;
    ``engine.state.fault_tolerance.last`` is its :class:`~fault_tolerant_handlers.RecoveryInfo`)."""

    FAILURE_SEEN = "fault_tolerance_failure_seen"
    RECOVERY_STARTED = "fault_tolerance_recovery_started"
    RECOVERED = "fault_tolerance_recovered"


class IgniteRecovery(LoopRecovery):
    """:class:`FaultToleranceEvents` and ``engine.state.fault_tolerance`` on one engine."""

    loops: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()
    last_completed: int | None = None

    def attach(self, engine: Engine) -> None:
        missing = [e for e in FaultToleranceEvents if not engine.has_registered_events(e)]
        if missing:
            engine.register_events(*missing)
        engine.state.fault_tolerance = recoveries.metrics()
        self.attached(engine)
        engine.add_event_handler(Events.STARTED, self._started)

    def _started(self, engine: Engine) -> None:
        info = self.carried_on(engine.state.iteration)
        engine.state.fault_tolerance = recoveries.metrics()
        if info is not None:
            engine.fire_event(FaultToleranceEvents.RECOVERED)


def _hook(info: recoveries.RecoveryInfo) -> None:
    """``FAILURE_SEEN``, ``RECOVERY_STARTED``: their events on the failed attempt's engines."""
    event = FaultToleranceEvents[info.phase.name]

    def fire_on(engine: Engine) -> None:
        engine.state.fault_tolerance = recoveries.metrics()
        engine.fire_event(event)
    IgniteRecovery.tell_failed_loops(info, fire_on, f"{event.name} handler")


# -- live state ------------------------------------------------------------------------------------
#: Objects of ``to_save`` whose state only an optimizer update changes: taken at the failure.
_BIG = (torch.nn.Module, torch.optim.Optimizer, DDPBucketLayout, torch.amp.GradScaler, ShardedState)


def _unwrap(obj: Any) -> Any:
    return obj.module if isinstance(obj, (torch.nn.DataParallel, DistributedDataParallel)) else obj


class IgniteLive(LiveLoop):
    """Live state (:mod:`.data.live`) of one Ignite trainer: the ``to_save`` of its ``Checkpoint`` handlers."""

    replicates = True
    engine: Engine | None = None

    def __init__(self) -> None:
        self.to_save: dict[str, Any] = {}

    def attach(self, engine: Any) -> None:
        _compat_ignite.prepend(engine, Events.STARTED, self._restore)
        _compat_ignite.prepend(engine, Events.ITERATION_STARTED, self._iteration_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.COMPLETED, lambda _: self.close())

    def _find(self, engine: Any) -> None:
        checkpoints = [h for h in _compat_ignite.attached_handlers(engine) if isinstance(h, Checkpoint)]
        self.to_save, self.directory, self.why_not = {}, None, ""
        for handler in checkpoints:
            for key, obj in (handler.to_save or {}).items():
                self.to_save.setdefault(key, obj)
            dirname = getattr(handler.save_handler, "dirname", None)
            if dirname is not None and self.directory is None:
                self.directory = str(Path(dirname).resolve())
        if not checkpoints:
            self.why_not = "no ignite Checkpoint handler is attached to the trainer: nothing says what to capture"
        elif any(not callable(getattr(obj, "state_dict", None)) for obj in self.to_save.values()):
            self.why_not = "the Checkpoint's to_save holds objects without state_dict (nested containers)"

    def _restore(self, engine: Any) -> None:
        """The first ``STARTED`` handler: live state the script did not load goes into ``to_save``."""
        self._find(engine)
        to_save, why = dict(self.to_save), self.why_not

        def restore(state: Any) -> str:
            state = sharded.rebuild(state, to_save.values())
            to_load = {key: obj for key, obj in to_save.items() if key in state}
            Checkpoint.load_objects(to_load=to_load, checkpoint=state)
            left = sorted(set(to_save) - set(to_load))
            return (f"the trainer's Checkpoint objects ({', '.join(to_load)})"
                    + (f"; not in the live state: {', '.join(left)}" if left else ""))

        live.loop_starts("iteration", lambda: int(engine.state.iteration), None if why else restore, why,
                         data=lambda: (mid_epoch_data(engine) or (None,))[0])

    def _started(self, engine: Any) -> None:
        self.close()
        if not live.enabled():
            return
        _compat_ignite.append_last(engine, Events.ITERATION_COMPLETED, self._iteration_completed)
        self._find(engine)
        self.engine = engine
        modules = [o.model if isinstance(o, ShardedState) else _unwrap(o) for o in self.to_save.values()
                   if isinstance(o, (torch.nn.Module, ShardedState))]
        self._begin(modules, update_at_pre_hook=True)

    def _iteration_started(self, engine: Any) -> None:
        self.step_starts(engine.state.iteration - 1)

    def _iteration_completed(self, engine: Any) -> None:
        if self.tracker is not None:
            self._mark()
            self._replicate(engine.state.iteration)

    def _mark(self, initial: bool = False) -> None:
        if self.why_not:
            return
        small: dict[str, Any] = {}
        for key, obj in self.to_save.items():
            if isinstance(obj, torch.optim.Optimizer):
                small[key] = self.hyper(obj)
            elif not isinstance(obj, _BIG):
                small[key] = obj.state_dict()
        self.tracker.complete(self.engine.state.iteration, small, initial=initial)

    def capture(self) -> live.Captured:
        tracker = self._tracked("the trainer was not running")
        state: dict[str, Any] = {}
        for key, obj in self.to_save.items():
            if isinstance(obj, torch.optim.Optimizer):
                state[key] = self.with_hyper(obj.state_dict(), tracker.small[key])
            elif isinstance(obj, _BIG):
                state[key] = _unwrap(obj).state_dict()
            else:
                state[key] = tracker.small[key]
        return live.Captured(tracker.step, "iteration", state, self.directory, tracker.rng_after(tracker.step))


#: The key of a DDP's bucket layout added to a ``Checkpoint``'s ``to_save`` that holds the DDP or its model.
LAYOUT_KEY = "fault_tolerance_ddp_buckets"


class SafeDiskSaver(DiskSaver):
    """Ignite's ``DiskSaver`` (same arguments) that removes old checkpoints only once the new one is
    written: a kill at any moment leaves ``n_saved`` complete checkpoints (``DiskSaver``: one fewer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fth_pending_removal: list[str] = []

    def __call__(self, checkpoint: Any, filename: str, metadata: Any = None) -> None:
        with interrupts.SECTION:
            found = sharded.find(checkpoint, "checkpoint")
            if found is not None:
                raise TypeError(f"SafeDiskSaver: {found[0]} is {found[1]}: a saver that writes on rank "
                                f"{self.save_on_rank} only would keep that rank's shards alone; save a sharded model "
                                "with fault_tolerant_handlers.ignite.DCPSaver (every rank writes its shards)")
            super().__call__(checkpoint, filename, metadata)  # raises (or is killed): nothing is removed
            snapshots.keep(self.dirname / filename, checkpoint)  # recovering in place: read from memory
            pending, self._fth_pending_removal = self._fth_pending_removal, []
            for name in pending:
                if name != filename:  # the same name saved again: the new file replaced it already
                    super().remove(name)

    def remove(self, filename: str) -> None:
        self._fth_pending_removal.append(filename)


def _discard(path: Path, then: Callable[[], None] = lambda: None) -> None:
    """Remove the directory ``path`` renamed to ``tmp-<name>.old`` first; ``then()`` runs in between."""
    trash = path.with_name(f"tmp-{path.name}.old")
    shutil.rmtree(trash, ignore_errors=True)  # a removal a killed attempt left
    if path.exists():
        os.replace(path, trash)
    then()
    shutil.rmtree(trash, ignore_errors=True)


class DCPSaver(BaseSaveHandler):
    """A save handler for Ignite's ``Checkpoint`` that writes a distributed checkpoint on **every** rank
    (a sharded model's shards; ``DiskSaver`` writes on one): a directory per checkpoint, renamed into
    place by rank 0 once complete, old ones removed after (docs/sharded.md). ``dirname``: one folder
    every rank sees; ``to_save`` holds the model and its optimizers as a ``ShardedState``."""

    def __init__(self, dirname: str | os.PathLike) -> None:
        if not isinstance(dirname, (str, os.PathLike)):
            raise TypeError(f"DCPSaver(dirname={dirname!r}): expected a str or os.PathLike")
        self.dirname = Path(dirname).expanduser()
        self._pending_removal: list[str] = []

    @staticmethod
    def _name(filename: str) -> str:
        stem, ext = os.path.splitext(filename)
        return stem if ext in (".pt", ".pth") else filename

    def __call__(self, checkpoint: Any, filename: str, metadata: Any = None) -> None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        name = self._name(filename)
        final, temporary = self.dirname / name, self.dirname / f"tmp-{name}"
        with interrupts.SECTION:
            if rank == 0:
                self.dirname.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(temporary, ignore_errors=True)  # a write a killed attempt left
                temporary.mkdir()
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            dcp.save_dcp(checkpoint, temporary)  # collective; returns once .metadata is written
            pending, self._pending_removal = self._pending_removal, []
            if rank == 0:
                _discard(final, then=lambda: os.replace(temporary, final))  # the new one in place before any goes
                for old in pending:
                    if self._name(old) != name:
                        _discard(self.dirname / self._name(old))

    def remove(self, filename: str) -> None:
        self._pending_removal.append(filename)


def check_mid_epoch_resume(engine: Any) -> str | None:
    """Warn when ``engine`` resumes inside an epoch and its loader will not continue there; return the warning."""
    gap = mid_epoch_data(engine)
    if gap is None:
        return None
    epoch, done = divmod(engine.state.iteration, engine.state.epoch_length)
    where = (f"the engine resumes at iteration {engine.state.iteration} (batch {done} of epoch {epoch + 1}, epoch_length "
             f"{engine.state.epoch_length})")
    message = f"{where}, but {gap[0]}, not the batches an uninterrupted run trains. {gap[1]}"
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    log(logging.WARNING, "%s", message, step=engine.state.iteration)
    return message


def mid_epoch_data(engine: Any) -> tuple[str, str] | None:
    """``(what, advice)`` when ``engine`` resumes inside an epoch and its loader will not continue there."""
    state = engine.state
    length, iteration, loader = state.epoch_length, state.iteration, state.dataloader
    if not length or not iteration or iteration % length == 0 or loader is None:
        return None
    epoch, done = divmod(iteration, length)
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        return (f"the data of epoch {epoch + 1} restarts from its beginning ({type(loader).__name__} has no "
                f"state_dict/load_state_dict): Ignite draws its remaining {length - done} iterations from the "
                "start of the epoch",
                "Use fault_tolerant_handlers.RestartableDataLoader (or make_restartable) and put it in the "
                "checkpoint's to_save / to_load")
    if not isinstance(loader, RestartableDataLoader):
        return None
    state = loader.state_dict()  # the batch of its pass the loader's next iter() starts at (0: a new pass)
    batch = 0 if state["epoch_finished"] else state["batches_yielded"]
    if batch == done:
        return None
    start = "batch 0 (a new pass over the data)" if batch == 0 else f"batch {batch}"
    return (f"the loader's next iter() starts at {start}",
            "Was it left out of Checkpoint.load_objects(to_load=...)? Put the loader in to_save and to_load")


# -- a DDP's bucket layout beside the model (a resume exact at 3+ ranks) ------------------------------------
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log(logging.WARNING, "%s", message)


def find_ddp(objects: Iterable[Any]) -> DistributedDataParallel | None:
    """The DDP among ``objects`` or wrapping a model among them (named by an ``Engine``'s step, or from 3 ranks
    on found in the heap)."""
    objects = list(objects)
    for obj in objects:
        if isinstance(obj, DistributedDataParallel):
            return obj
    modules = [obj for obj in objects if isinstance(obj, torch.nn.Module)]
    if not modules:
        return None

    def wraps(value: Any) -> bool:
        return isinstance(value, DistributedDataParallel) and any(value.module is m for m in modules)

    for engine in (obj for obj in objects if isinstance(obj, Engine)):
        found = next((v for v in _compat_ignite.step_names(engine) if wraps(v)), None)
        if found is not None:
            return found
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() >= 3):
        return None
    return next((obj for obj in gc.get_objects() if type(obj) is DistributedDataParallel and wraps(obj)), None)


def _layout_of(ddp: DistributedDataParallel | None) -> DDPBucketLayout | None:
    """The one layout of ``ddp``, kept on it: the layout a load gave it is what it saves."""
    if ddp is None:
        return None
    layout = getattr(ddp, "_fth_bucket_layout", None)
    if layout is None:
        try:
            layout = ddp._fth_bucket_layout = DDPBucketLayout(ddp)
        except RuntimeError as err:  # this torch lacks a name the layout needs: named once
            _warn_once(f"the DDP's bucket layout is not saved with the checkpoint ({err}): a resume at 3 ranks or "
                       "more may differ from the uninterrupted run in the last bits")
    return layout


def add_bucket_layouts(engine: Any, checkpoints: Iterable[Any]) -> None:
    """Each ``Checkpoint`` whose ``to_save`` (2+ objects) holds a DDP or its model saves its layout too (a new dict)."""
    for handler in checkpoints:
        to_save = handler.to_save
        if not isinstance(to_save, dict) or len(to_save) < 2 or LAYOUT_KEY in to_save or any(
                isinstance(obj, DDPBucketLayout) for obj in to_save.values()):
            continue
        layout = _layout_of(find_ddp([*to_save.values(), engine]))
        if layout is not None:
            handler.to_save = {**to_save, LAYOUT_KEY: layout}


def give_bucket_layout(to_load: Any, checkpoint: Any) -> None:
    """After ``Checkpoint.load_objects(to_load, checkpoint)``: the saved layout goes to the DDP of ``to_load``."""
    if not isinstance(checkpoint, dict) or not isinstance(to_load, dict) or LAYOUT_KEY in to_load:
        return
    saved = checkpoint.get(LAYOUT_KEY)
    if not isinstance(saved, dict) or saved.get("buckets") is None:
        return
    layout = _layout_of(find_ddp(to_load.values()))
    if layout is None:
        return
    try:
        layout.load_state_dict(saved)
    except (RuntimeError, ValueError) as err:
        _warn_once(f"the checkpoint's DDP bucket layout is not used ({err}): a resume at 3 ranks or more may "
                   "differ from the uninterrupted run in the last bits")


# once per process: every Checkpoint.load_objects gives a DDP its checkpoint's bucket layout
_compat_ignite.hook_load_objects(take=live.take, read=lambda path: torch.load(path, weights_only=True),
                                 after=give_bucket_layout)
