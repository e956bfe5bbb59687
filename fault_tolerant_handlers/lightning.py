"""Lightning adapter: ``Trainer(callbacks=[FaultTolerance()])``.

Maps Lightning's ``Callback`` hooks onto the framework-neutral
:class:`~fault_tolerant_handlers.adapters.guard.Guard`; one module for everything Lightning (live
state, a recovery's hooks), Lightning's private API in :mod:`.adapters.compat_lightning`:

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
``on_before_optimizer_step``    ``on_exception`` (:class:`LightningLive`)
``on_fit_start``,               a DDP model's bucket layout (:class:`.data.ddp_buckets.DDPBucketLayout`):
``state_dict``,                 saved in this callback's state, given back to the new DDP before its
``load_state_dict``             first step, so that a resumed run is exact at any world size
``on_train_start``,             recovering in place: the hooks ``on_failure_seen``,
``on_train_batch_end``,         ``on_recovery_started``, ``on_recovered`` called on every callback (and
``on_exception``                the module) that defines them; the recovery's numbers logged at the
                                first batch after it (:class:`LightningRecovery`)
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
import os
import weakref
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from typing_extensions import override

from .adapters import compat_lightning as _compat_lightning
from .core import attempts, hooks, interrupts, phases, recoveries, sharded
from .data import live, snapshots
from .data.ddp_buckets import DDPBucketLayout
from .core.errors import HangInterrupted, RecoveryError
from .core.failure import tag, tag_of
from .core.hooks import first_line, log
from .detect.autohang import CHECKPOINT, EVALUATION, START, STEP
from .adapters.guard import Guard, LiveLoop, LoopRecovery
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
        first = first_line(err, 300)
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
        self.guard.beat(int(trainer.global_step), START)

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
        self._live.step_starts(int(trainer.global_step))
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


# -- live state --------------------------------------------------------------------------------------
class LightningLive(LiveLoop):
    """Live state (:mod:`.data.live`) of one Lightning ``Trainer``, from what ``trainer.save_checkpoint``
    would write; driven by the :class:`FaultTolerance` callback while a recovery in place runs:

    * ``on_train_start``: the loops are set up; the state the loop starts from is the first mark;
    * ``on_train_batch_start``: torch's RNG as the batch starts;
    * ``on_before_optimizer_step``: the optimizer's update begins (the training step and backward ran
      inside ``optimizer.step``'s closure before this; a failure there leaves the state trusted);
    * ``on_train_batch_end``: the batch completed: the loops' state (progress, the loader's position),
      the global step and epoch, the LR schedulers and the optimizers' hyper-parameters, as a
      ``ModelCheckpoint`` saving in this hook would hold them;
    * ``on_exception``: the capture: ``dump_checkpoint`` (model, optimizers, callbacks, as they are: no
      update ran since the mark), with the marked parts put in.
    """

    unit = "global step"

    def __init__(self) -> None:
        super().__init__()
        self.trainer: Any = None
        self._parts: tuple[list, list] = ([], [])

    def train_start(self, trainer: Any) -> None:
        self.close()
        if not live.enabled():
            return
        self.trainer, self.why_not, self.directory = trainer, "", None
        if not _compat_lightning.plain_ddp(trainer.strategy):
            why = (f"the strategy {type(trainer.strategy).__name__} builds its checkpoint with collectives "
                   "(live state: DDPStrategy only)")
            found = sharded.in_module(trainer.lightning_module)
            self._refuse(f"{why}; the model is sharded ({found})" if found else why)  # shards: not served
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath:
                self.directory = str(Path(dirpath).resolve())
                break
        self._parts = _compat_lightning.loop_parts(trainer.fit_loop)
        self._begin([trainer.lightning_module], update_at_pre_hook=False)

    def update_begins(self) -> None:
        if self.tracker is not None:
            self.tracker.update_begins()

    def batch_end(self) -> None:
        if self.tracker is not None:
            self._mark()

    def _mark(self, initial: bool = False) -> None:
        if self.why_not:
            return
        trainer = self.trainer
        small = {
            "loops": _compat_lightning.snapshot_loops(self._parts),
            "epoch": int(trainer.current_epoch),
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "param_groups": [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                             for optimizer in trainer.optimizers],
        }
        self.tracker.complete(int(trainer.global_step), small, initial=initial)

    def capture(self) -> live.Captured:
        tracker = self._tracked("the trainer was not fitting")
        small = tracker.small
        checkpoint = _compat_lightning.dump_checkpoint(self.trainer)
        checkpoint["loops"]["fit_loop"] = _compat_lightning.loop_state(self._parts, small["loops"])
        checkpoint["global_step"], checkpoint["epoch"] = tracker.step, small["epoch"]
        if "lr_schedulers" in checkpoint:
            checkpoint["lr_schedulers"] = small["lr_schedulers"]
        for saved, hyper in zip(checkpoint.get("optimizer_states", []), small["param_groups"]):
            if isinstance(saved, dict) and isinstance(saved.get("param_groups"), list):
                saved["param_groups"] = [{**group, **h} for group, h in zip(saved["param_groups"], hyper)]
        return live.Captured(tracker.step, "global step", checkpoint, self.directory, tracker.rng_after(tracker.step))


# -- a recovery in place's moments, as hooks ------------------------------------------------------------
#: The hooks, by the moment they tell.
HOOKS = {recoveries.RecoveryPhase.FAILURE_SEEN: "on_failure_seen",
         recoveries.RecoveryPhase.RECOVERY_STARTED: "on_recovery_started",
         recoveries.RecoveryPhase.RECOVERED: "on_recovered"}
#: The first attempt's loggers' ``(class, root folder, version, folder)`` (:func:`.adapters.compat_lightning.logger_versions`),
#: while a recovery in place runs.
_logger_versions: list = []
#: A CSV logger's ``metrics.csv`` as the failed attempt left it, by folder (read at the teardown).
_kept_metrics: dict[str, bytes] = {}


def _pinned_version(logger: Any) -> Any:
    """The first attempt's version for a logger of the same class and root folder (``None``: none)."""
    for cls, root, version, _ in _logger_versions:
        if type(logger) is cls and str(getattr(logger, "root_dir", "")) == root:
            return version
    return None


def _keep_logger_versions(state: phases.RecoveryState) -> None:
    """``RESET_FRAMEWORKS``: the next attempt's loggers take the first attempt's versions; a CSV
    logger's rows are read now (its writer deletes the file when the next attempt opens the folder)."""
    if not _logger_versions:
        return
    _compat_lightning.pin_next_versions({cls for cls, *_ in _logger_versions}, _pinned_version)
    for *_, folder in _logger_versions:
        path = os.path.join(folder, "metrics.csv")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                _kept_metrics[folder] = f.read()


def _forget_logger_versions(state: phases.RecoveryState) -> None:
    """``END``: loggers made after the recovery take the next free version again."""
    _logger_versions.clear()
    _kept_metrics.clear()


def dispatch(trainer: Any, hook: str, info: recoveries.RecoveryInfo) -> None:
    """Call ``hook`` on every callback of ``trainer`` that has it, then on its LightningModule."""
    pl_module = getattr(trainer, "lightning_module", None)
    for callback in list(trainer.callbacks):
        method = getattr(callback, hook, None)
        if callable(method):
            method(trainer, pl_module, info)
    method = getattr(pl_module, hook, None)
    if callable(method):
        method(info)


class LightningRecovery(LoopRecovery):
    """One ``FaultTolerance`` callback's part of a recovery in place.

    Lightning runs a hook by its name on every callback that has it (and, for the model's hooks, on the
    ``LightningModule``); the :class:`~fault_tolerant_handlers.lightning.FaultTolerance` callback does the
    same for three hooks of its own, so that any callback (no base class to inherit, either namespace)
    or the module can take them:

    =========================  =================================================  ========================
    hook                       when                                               on the module
    =========================  =================================================  ========================
    ``on_failure_seen``        the failure reached this rank's recovery (the      ``on_failure_seen(info)``
                               failed attempt's trainer; the recovery runs)
    ``on_recovery_started``    the ranks agreed to recover (the failed            ``on_recovery_started(info)``
                               attempt's trainer)
    ``on_recovered``           the next attempt's ``on_train_start``: the         ``on_recovered(info)``
                               checkpoint or live state is loaded, the step it
                               carries on from is its global step
    =========================  =================================================  ========================

    A callback's hook is called ``hook(trainer, pl_module, info)``, with ``info`` a
    :class:`~.core.recoveries.RecoveryInfo`. An exception in the first two is logged, never passed on
    (the recovery must go on); in ``on_recovered`` it fails the run, as in any hook. At the end of the
    first training batch after a recovery the callback logs ``fault_tolerance/recoveries``,
    ``fault_tolerance/time_to_recover`` and ``fault_tolerance/steps_computed_twice`` to every logger of
    the trainer (``logger.log_metrics``, at that step: not held back to ``log_every_n_steps``) and into
    ``trainer.callback_metrics`` (put there directly: :func:`.adapters.compat_lightning.put_callback_metrics`).
    """

    loops: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
    last_completed: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self._log_pending = False

    def setup(self, trainer: Any) -> None:
        self.attached(trainer)
        # One logger version for the whole run: the first attempt's loggers' versions are recorded; a
        # recovered attempt's loggers take them (a new Trainer's would take the next free version_N).
        try:
            if not attempts.in_place():
                _logger_versions[:] = _compat_lightning.logger_versions(trainer)
            else:
                restored = _compat_lightning.restore_csv_metrics(trainer, _kept_metrics)
                if restored:
                    log(logging.INFO, "the recovered attempt logs on in the first attempt's folder: %s",
                        "; ".join(restored))
        except Exception as err:  # noqa: BLE001 - a logger of another shape: a version of its own, as before
            log(logging.WARNING, "could not keep the first attempt's logger version: %s: %s", type(err).__name__,
                first_line(err))

    def train_start(self, trainer: Any) -> None:
        info = self.carried_on(int(trainer.global_step))
        if info is not None:
            self._log_pending = True
            dispatch(trainer, HOOKS[info.phase], info)

    def batch_end(self, trainer: Any, pl_module: Any) -> None:
        self.completed = int(trainer.global_step)
        if not self._log_pending:
            return
        self._log_pending = False
        values = recoveries.metrics().as_dict()
        if not _compat_lightning.put_callback_metrics(trainer, values):
            for name, value in values.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, logger=False, sync_dist=False)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=int(trainer.global_step))


def _hook(info: recoveries.RecoveryInfo) -> None:
    LightningRecovery.tell_failed_loops(info, lambda trainer: dispatch(trainer, HOOKS[info.phase], info),
                                        f"{HOOKS[info.phase]} hook")


hooks.add(hooks.FAILURE_SEEN, _hook)
hooks.add(hooks.RECOVERY_STARTED, _hook)
hooks.add(hooks.RESET_FRAMEWORKS, _keep_logger_versions, tolerate=True)
hooks.add(hooks.END, _forget_logger_versions, tolerate=True)
