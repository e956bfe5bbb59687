"""Lightning adapter: ``Trainer(callbacks=[FaultTolerance()])``.

Maps Lightning's ``Callback`` hooks onto the framework-neutral
:class:`~fault_tolerant_handlers.adapters.guard.Guard`:

==============================  ======================================================================
``setup``                       start (collective: side group, watchdog); this callback moves itself
                                to the front of ``trainer.callbacks`` so that its ``on_exception``
                                runs before any other (``OnExceptionCheckpoint``'s barrier)
``on_*_batch_start/_end``       heartbeat, and a look at the watchdog (no communication); every
                                ``sync_every`` training batches, one flag agreement
``on_train_epoch_start``,       (``hang_timeout="auto"``) where a kind of work begins: training
``on_validation_start``,        steps, an evaluation (each validation batch), a checkpoint; the
``on_save_checkpoint``          epoch-end hooks and what follows a validation are kinds of their own
``on_validation_end``,          agreement, *before* the monitoring callbacks (``ModelCheckpoint``,
``on_train_epoch_end``          ``EarlyStopping``), so no checkpoint is written once any rank failed
``on_train_end``                agreement (end of run), then a clean stop of the watchdog
``on_exception``                record and release (local failure) or convert to ``PeerFailedError``;
                                then finishes Lightning's exception path itself (see below)
``teardown``                    clean stop of the watchdog (``validate``/``test``)
``on_train_start``,             recovering in place only: live state's bookkeeping and its capture at
``on_before_optimizer_step``    ``on_exception`` (:mod:`.adapters.live_lightning`)
``on_fit_start``,               a DDP model's bucket layout (:class:`.data.ddp_buckets.DDPBucketLayout`):
``state_dict``,                 saved in this callback's state, given back to the new DDP before its
``load_state_dict``             first step, so that a resumed run is exact at any world size
``on_train_start``,             recovering in place: the hooks ``on_failure_seen``,
``on_train_batch_end``,         ``on_recovery_started``, ``on_recovered`` called on every callback (and
``on_exception``                the module) that defines them; the recovery's numbers logged at the
                                first batch after it (:mod:`.adapters.recovery_lightning`)
==============================  ======================================================================

Why ``on_exception`` finishes the exception path itself: Lightning re-raises the exception it
caught and lets nothing replace it, and an ``on_exception`` hook that raises (``OnExceptionCheckpoint``
whose barrier fails because the failing rank's collectives were released) would hide the cause. So
this callback runs the other callbacks' ``on_exception`` (a failure there is logged, never raised),
then the rest of Lightning's ``_interrupt`` and the trainer's teardown, and raises what this rank
must raise: its own exception, or the peer's :class:`PeerFailedError`.

Launchers. ``strategy="ddp"`` (Lightning's subprocess launcher) and ``torchrun`` call ``on_exception``
in each rank. ``ddp_spawn`` / ``ddp_fork`` call it in the *parent* process only (after the ranks
have exited); the ranks themselves get no hook on the exception path. For them, ``setup`` wraps the
run of the training stage in the rank, so a failure is recorded and released, and a peer's failure
converted, inside the rank, and the checkpoint callbacks' ``on_exception`` (``OnExceptionCheckpoint``)
runs there, where the trained state is. In the parent, which holds only the untrained model, the
callback skips the checkpoint callbacks (stock Lightning 2.6.6 saves the untrained parent model as
``on_exception.ckpt``) and keeps the other callbacks' ``on_exception`` from hiding the rank's error.

Both namespaces: ``lightning.Trainer`` and ``pytorch_lightning.Trainer`` both take the callback. It
is a ``Callback`` of each one installed, and it looks Lightning's classes up in the namespace of
the trainer it is given (:mod:`.adapters.compat_lightning`).

Private Lightning API: see :mod:`.adapters.compat_lightning`. Everything else is public
``Callback``/``Trainer`` API.
"""

from __future__ import annotations

import functools
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping

from typing_extensions import override

from .adapters import compat_lightning as _compat_lightning
from .adapters.live_lightning import LightningLive
from .adapters.recovery_lightning import LightningRecovery
from .core import attempts, interrupts
from .data import live, snapshots
from .data.ddp_buckets import DDPBucketLayout
from .core.errors import HangInterrupted, RecoveryError
from .core.failure import tag, tag_of
from .core.log import log
from .detect.autohang import CHECKPOINT, EVALUATION, STEP
from .adapters.guard import Guard
from .core.inject import Injector

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback as _CallbackBase
else:
    _bases = _compat_lightning.callback_bases()
    if len(_bases) == 1:
        (_CallbackBase,) = _bases
    else:  # lightning.pytorch and pytorch_lightning both installed: a Callback of either
        _CallbackBase = type("_CallbackBase", _bases, {"__module__": __name__})

__all__ = ["FaultTolerance"]


def _guarded(what: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - logged: the cause must reach every rank unchanged
        first = str(err).splitlines()[0][:300] if str(err) else ""
        log(logging.WARNING, "%s failed while the job fails together (ignored, the cause is raised instead): %s: %s",
            what, type(err).__name__, first)


class FaultTolerance(_CallbackBase):
    """Make a distributed Lightning run fail together: one callback, on every rank.

    An exception on one rank (``training_step``, ``validation_step``, a dataloader, another
    callback, a rank-zero-only block) makes ``trainer.fit`` raise on **every** rank within a couple
    of seconds: the failing rank its own exception, the others
    :class:`~fault_tolerant_handlers.PeerFailedError` with the failing rank, its exception, message
    and traceback, the global step and the epoch. Ranks blocked in a collective with the failing
    rank (DDP's gradient all_reduce, a barrier, ``OnExceptionCheckpoint``'s barrier) are released at
    once instead of waiting for the process-group timeout. ``ModelCheckpoint`` writes nothing once a
    rank failed (it runs after this callback's agreement at the end of an epoch and of validation),
    so its last checkpoint stays the last good one; ``OnExceptionCheckpoint`` still saves rank 0's
    state (complete; its closing barrier fails fast and is logged). On a single device it does
    nothing.

    Works with ``strategy="ddp"``, ``"ddp_spawn"`` and scripts started by ``torchrun``.

    Args:
        sync_every: training batches between flag agreements within an epoch (default 100;
            ``None``: only at the end of validation, of each epoch and of the run). Each agreement
            is one int64 all_reduce on a gloo side group; the watchdog covers the batches between.
        hang_timeout: opt-in; a duration (a ``timedelta``, a number of seconds, a
            ``"DD:HH:MM:SS"`` string or a dict such as ``{"minutes": 5}``, as Lightning's ``Timer``
            takes them; from 1 s to 7 days): a rank whose loop makes no progress for this long is
            declared hung and every rank ends with its stack. ``"auto"``: the deadline is learned
            per kind of work (training batches; validation, batch by batch; checkpoint saves), see
            docs/hang-detection.md. ``None``: off (env ``FTH_HANG_TIMEOUT_SEC``, seconds or ``auto``).
        watchdog: start the out-of-band watchdog (default True).
        name: the loop's name in reports (``'train' (epoch 1, iteration 12)``); also part of
            :attr:`state_key`, so two instances with different names can coexist.

    Raises:
        ValueError: ``sync_every`` is not a positive int or ``None``; ``hang_timeout`` is a duration
            outside 1 s to 7 days; an ``FTH_*`` environment variable is out of its range.
        TypeError: ``hang_timeout`` is none of its accepted forms; ``watchdog`` is not a bool;
            ``name`` is not a non-empty str (an empty name included).

    Examples:
        .. code-block:: python

            import lightning as L
            from lightning.pytorch.callbacks import OnExceptionCheckpoint
            from fault_tolerant_handlers.lightning import FaultTolerance

            trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                                callbacks=[FaultTolerance(), OnExceptionCheckpoint("ckpts")])
            trainer.fit(model, datamodule)   # raises on every rank if any rank raises

    .. warning::
        Give it to the ``Trainer`` of **every** rank. Wrong:
        ``callbacks=[FaultTolerance()] if rank == 0 else []`` (the other ranks would not join the
        agreements). Correct: ``callbacks=[FaultTolerance()]`` unconditionally.
    """

    def __init__(
        self,
        sync_every: int | None = 100,
        hang_timeout: timedelta | float | str | dict | None = None,
        watchdog: bool = True,
        name: str = "train",
    ) -> None:
        self.guard = Guard(sync_every=sync_every, hang_timeout=hang_timeout, watchdog=watchdog, name=name)
        self.name = name
        self._batches = 0
        self._in_batch: int | None = None  # the step a training batch trains (global_step + 1), while it runs
        self._buckets: DDPBucketLayout | None = None  # the DDP's bucket layout, from on_fit_start on
        self._loaded_buckets: Any = None  # the checkpoint's, until the DDP exists (on_fit_start)
        self._injector = Injector.from_env()  # FTH_INJECT: rehearse a failure without editing the job
        self._live = LightningLive()  # recovering in place: the trainer's live state (data.live)
        self._recovery = LightningRecovery()  # recovering in place: its hooks and numbers

    # -- state ---------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        # Lightning formats it for every hook it dispatches (twice per batch): built once per name.
        cached = self.__dict__.get("_state_key_cache")
        if cached is None or cached[0] != self.name:
            cached = self._state_key_cache = (self.name, self._generate_state_key(name=self.name))
        return cached[1]

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"batches": self._batches}
        buckets = self._buckets.buckets if self._buckets is not None else self._loaded_buckets
        if buckets is not None:
            state["ddp_buckets"] = buckets
        return state

    @override
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        batches = state_dict.get("batches", 0)  # absent in checkpoints of version 0.1
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"state_dict['batches'] must be a non-negative int, got {batches!r}")
        self._batches = batches
        self._loaded_buckets = state_dict.get("ddp_buckets")  # absent before 0.2; given to the DDP in on_fit_start

    # -- helpers -----------------------------------------------------------------------------------
    def _where(self, trainer: pl.Trainer) -> dict[str, int]:
        """Where a report says this rank is: inside a training batch, the step it trains (``global_step + 1``,
        1-based, the number ``FTH_INJECT``'s ``iteration=`` takes and Ignite's ``engine.state.iteration``
        tells); elsewhere (validation, an epoch's end) the steps completed (``global_step``)."""
        step = self._in_batch if self._in_batch is not None else int(trainer.global_step)
        return {"step": step, "epoch": int(trainer.current_epoch)}

    def _check(self, trainer: pl.Trainer) -> None:
        """Raise the peer's failure if the watchdog already knows it (no communication). Called
        twice per batch: two attribute reads unless there is a failure (where it happened, which
        costs Lightning's property lookups, is only worked out then)."""
        interrupts.raise_pending()  # a hung main thread's interrupt that user code swallowed
        session = self.guard.session
        if session is not None and session.failure.peer_error is not None:
            self.guard.check(**self._where(trainer))

    def _sync(self, trainer: pl.Trainer, where: str) -> None:
        self.guard.sync(where, **self._where(trainer))

    def _convert(self, trainer: pl.Trainer, exception: BaseException) -> BaseException:
        return self.guard.on_exception(exception, **self._where(trainer))

    # -- hooks -------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._in_batch = None
        self.guard.start()
        if not self.guard.active:
            return  # a single device, or no process group: nothing to coordinate
        _compat_lightning.check(trainer)
        if attempts.recovering():
            self._recovery.setup(trainer)
            self._keep_launched_ranks(trainer)
            if stage == "fit":  # live state the script did not pass as ckpt_path: loaded by fit all the same
                _compat_lightning.substitute_ckpt_path(
                    trainer, lambda path: live.substitute(path, "the trainer's fit(ckpt_path=...)"))
            # the newest checkpoint in memory: the next attempt's fit(ckpt_path=...) reads it from there,
            # unless the strategy loads the weights itself (sharded: ModelParallelStrategy, FSDPStrategy)
            why = _compat_lightning.restores_itself(trainer.strategy)
            if why:
                log(logging.WARNING, "checkpoints are not kept in memory for a recovery in place: %s", why)
            else:
                _compat_lightning.keep_checkpoints_in_memory(trainer.strategy, snapshots.keep, snapshots.take)
        # First in line on the exception path: release before any other on_exception runs a collective.
        # (Lightning iterates this very list; moving an already-called item to the front skips no one.)
        callbacks = trainer.callbacks
        if callbacks and callbacks[0] is not self and self in callbacks:
            callbacks.remove(self)
            callbacks.insert(0, self)
        if not _compat_lightning.on_exception_runs_in_rank(trainer):
            _compat_lightning.wrap_run_stage(trainer, functools.partial(self._run_stage_in_rank, trainer))
        self.guard.beat(int(trainer.global_step), "start")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The strategy wrapped the model (DDP) and the checkpoint's callback states are loaded: the
        DDP gets the checkpoint's bucket layout before its first step (a resume exact at 3+ ranks)."""
        from torch.nn.parallel import DistributedDataParallel

        model = getattr(trainer.strategy, "model", None)
        if not isinstance(model, DistributedDataParallel):
            self._buckets = None
            return
        self._buckets = DDPBucketLayout(model)
        if self._loaded_buckets is not None:
            self._buckets.load_state_dict({"buckets": self._loaded_buckets})

    @staticmethod
    def _keep_launched_ranks(trainer: pl.Trainer) -> None:
        """Recovering in place: the next attempt's Trainer must not start the other ranks again (a
        :class:`RecoveryError` if it would: every rank fails, and none recovers)."""
        try:
            if _compat_lightning.keep_launched_ranks(trainer):
                log(logging.INFO, "recover_in_place: LOCAL_RANK set in this process, which started the other ranks, "
                    "so that the next attempt's Trainer does not start them again")
        except RuntimeError as err:
            raise RecoveryError(str(err)) from err

    def _run_stage_in_rank(self, trainer: pl.Trainer, run_stage: Callable[[], Any]) -> Any:
        """Spawned ranks only: the exception path Lightning does not give them.

        Records and releases (or converts), then runs the ``on_exception`` of the checkpoint
        callbacks (``OnExceptionCheckpoint``) here, where the trained state is: the parent, which
        Lightning would have run them in, holds only the untrained model.
        """
        try:
            return run_stage()
        except (Exception, HangInterrupted) as exc:
            to_raise = self._convert(trainer, exc)
            for callback in list(trainer.callbacks):
                if isinstance(callback, _compat_lightning.checkpoint_types()):
                    _guarded(f"{type(callback).__name__}.on_exception",
                             functools.partial(callback.on_exception, trainer, trainer.lightning_module, exc))
            if to_raise is exc:
                raise
            raise to_raise from exc

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard.active and attempts.recovering():
            live.loop_starts("global step", lambda: int(trainer.global_step), None,
                             "fit(ckpt_path=...) did not load it")
            self._live.train_start(trainer)
            self._recovery.train_start(trainer)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._live.update_begins()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._in_batch = int(trainer.global_step) + 1  # taken before the optimizer step moves global_step
        self._live.batch_start(trainer)
        self._check(trainer)  # an attribute read: the watchdog may already know a peer failed
        if self._injector is not None:
            self._injector.maybe_fire(trainer.global_rank, self._in_batch, trainer.current_epoch,
                                      trainer.train_dataloader)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1
        self._in_batch = None
        self._live.batch_end()
        self._recovery.batch_end(trainer, pl_module)
        self.guard.beat(int(trainer.global_step), STEP, completed=True)
        if self.guard.due(self._batches):
            self._sync(trainer, "training batch")
        else:
            self._check(trainer)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self.guard.beat(int(trainer.global_step), _evaluation(trainer), completed=True)
        self._check(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.beat(int(trainer.global_step), STEP)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.beat(int(trainer.global_step), _evaluation(trainer))

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.guard.beat(int(trainer.global_step), CHECKPOINT)  # the file is written after this hook

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(trainer, "validation end")
        self.guard.beat(int(trainer.global_step), "after evaluation")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(trainer, "epoch end")
        self.guard.beat(int(trainer.global_step), "epoch end")
        restarts = getattr(trainer.train_dataloader, "restart_count", None)
        if restarts is not None:  # a RestartableDataLoader: its worker restarts, as a metric (max over ranks)
            pl_module.log("dataloader_restarts", float(restarts), reduce_fx="max", sync_dist=self.guard.active)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(trainer, "end of run")
        self._live.close()
        # Every rank is past the last agreement: a rank that now exits first is not a failure.
        self._stop_watchdog()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_watchdog()

    def _stop_watchdog(self) -> None:
        self.guard.stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if tag_of(exception).taken:
            return  # another FaultTolerance instance already finished the exception path
        in_parent = False
        if self.guard.active:
            to_raise = self._convert(trainer, exception)
            self._live.failed()  # the peers told first; then, before the exception path tears down, the state
            self._recovery.failed()
        elif _is_rank_process_error(exception):
            to_raise, in_parent = exception, True  # the parent of spawned ranks: keep the rank's error visible
        else:
            return  # a single process: stock Lightning
        if not isinstance(exception, (Exception, HangInterrupted)):
            return  # KeyboardInterrupt / SystemExit: Lightning's own path (it also stops the launcher)
        self._finish_exception_path(trainer, pl_module, exception, in_parent=in_parent)
        tag(exception, taken=True)  # once a FaultTolerance callback finished Lightning's exception path
        tag(to_raise, taken=True)
        if to_raise is exception:
            raise exception
        raise to_raise from exception

    def _finish_exception_path(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException,
                               *, in_parent: bool = False) -> None:
        callbacks = list(trainer.callbacks)
        start = callbacks.index(self) + 1 if self in callbacks else 0
        for callback in callbacks[start:]:
            if isinstance(callback, FaultTolerance):
                continue
            if in_parent and isinstance(callback, _compat_lightning.checkpoint_types()):
                # Its rank already ran it (see _run_stage_in_rank); here it would save the untrained model.
                log(logging.INFO, "%s.on_exception is not run in the parent of spawned ranks (it holds only the "
                    "untrained model; the ranks ran it)", type(callback).__name__)
                continue
            _guarded(f"{type(callback).__name__}.on_exception",
                     functools.partial(callback.on_exception, trainer, pl_module, exception))
        for what, step in _compat_lightning.interrupt_steps(trainer, exception):
            _guarded(what, step)
        trainer.state.stage = None


def _evaluation(trainer: pl.Trainer) -> str:
    # Lightning's sanity check (a couple of batches before training) teaches nothing about a real
    # validation: a kind of its own.
    return "sanity check" if trainer.sanity_checking else EVALUATION


def _is_rank_process_error(exc: BaseException) -> bool:
    """The error ``torch.multiprocessing`` raises in the parent when a spawned rank failed."""
    try:
        from torch.multiprocessing.spawn import ProcessException
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, ProcessException)

