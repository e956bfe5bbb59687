"""What the Ignite and Lightning adapters share beyond their loop's :class:`~..core.session.Guard`: a
loop's live state (:class:`LiveLoop`), its part of a recovery in place (:class:`LoopRecovery`) and their
recovery steps; each framework's private API is in its compat module (:mod:`.compat_ignite`,
:mod:`.compat_lightning`), checked at start."""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..core import attempts, compat_torch, config, recoveries, rng_state, sharded
from ..core.failure import Stored
from ..core.hooks import first_line, log
from ..core.schema import logger_version_key
from ..core.phases import RecoveryState
from ..data import live
from ..data.replicas import ShardReplicas
from . import compat_ignite, compat_lightning


def _resolve_live_names(state: RecoveryState) -> None:
    """The next attempt may carry on from live state: Ignite's ``Checkpoint.load_objects(to_load, path)``
    resolves the name ``latest_checkpoint`` gives for it."""
    if live.held() is not None:
        compat_ignite.hook_load_objects(take=live.take)


# -- Lightning's loggers: one version across a recovery in place --------------------------------------
@dataclass(frozen=True)
class LoggerVersion(Stored):
    """A numbered logger of rank 0's first attempt, writing in ``<root>/version_<version>``: a replacement
    of a rank's process (which ran no teardown, so holds no versions) numbers its loggers the same."""

    namespace: str  #: "lightning.pytorch" or "pytorch_lightning"
    cls: str  #: the class's name in ``<namespace>.loggers``
    root: str  #: the logger's ``root_dir``
    version: int

    BOUNDS: ClassVar[dict] = {"namespace": 40, "cls": 100, "root": 4096, "version": (0, 2**31 - 1)}


MAX_LOGGERS = 8  #: numbered loggers of one trainer kept in the store (more: a version of their own)
#: The first attempt's loggers' ``(class, root folder, version, folder)``, while a recovery in place runs.
logger_versions: list = []
#: A CSV logger's ``metrics.csv`` as the failed attempt left it, by folder (read before the next attempt's writer).
kept_metrics: dict[str, bytes] = {}


def publish_logger_versions() -> None:
    """Rank 0's first attempt: :data:`logger_versions` in the store, for a replacement of any rank's process."""
    store = compat_torch.store_chain(compat_torch.default_store())[-1]
    numbered = [(cls, root, v) for cls, root, v, _ in logger_versions if isinstance(v, int) and v >= 0][:MAX_LOGGERS]
    for index, (cls, root, version) in enumerate(numbered):
        ns = "pytorch_lightning" if cls.__module__.split(".")[0] == "pytorch_lightning" else "lightning.pytorch"
        store.set(logger_version_key(index), LoggerVersion(ns, cls.__name__, root, version).to_json())
    store.delete_key(logger_version_key(len(numbered)))  # an earlier fit's: the reader stops at the first gap


def take_logger_versions(state: RecoveryState) -> None:
    """``RE_FORM``, in a replacement (it ran no teardown): rank 0's first attempt's versions, from the store."""
    if logger_versions or state.store is None:
        return
    for index in range(MAX_LOGGERS):
        key = logger_version_key(index)
        if not state.store.check([key]):
            break
        kept = LoggerVersion.from_json(state.store.get(key), state.world_size or 1, key=key)
        cls = None if kept is None else compat_lightning.logger_class(kept.namespace, kept.cls)
        if cls is not None:
            logger_versions.append((cls, kept.root, kept.version, os.path.join(kept.root, f"version_{kept.version}")))
    keep_logger_versions(state)


def keep_logger_versions(state: RecoveryState) -> None:
    """``RESET_FRAMEWORKS`` (and a replacement's ``RE_FORM``): the next attempt's loggers take the first's
    versions; CSV rows kept in memory (the next attempt's writer deletes the file when it opens the folder)."""
    compat_lightning.pin_next_versions(logger_versions)
    for *_, folder in logger_versions:
        path = os.path.join(folder, "metrics.csv")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                kept_metrics[folder] = f.read()


def forget_logger_versions(state: RecoveryState) -> None:
    """``END``: loggers made after the recovery take the next free version again."""
    logger_versions.clear()
    kept_metrics.clear()


class LiveLoop:
    """Live state of one training loop (:mod:`..data.live`): a step tracker registered while the loop
    runs, marked at each completed step (``_mark``) and captured at the failure (``capture``)."""

    unit = "iteration"  #: what a step is called in the loop's reports
    replicates = False  #: the loop calls ``_replicate`` at each step's end (``FTH_SHARD_REPLICAS``)
    tracker: live.StepTracker | None = None
    directory: str | None = None
    why_not = ""
    replicas: ShardReplicas | None = None

    def _begin(self, modules: list, update_at_pre_hook: bool) -> None:
        self.tracker = live.StepTracker(modules, update_at_pre_hook=update_at_pre_hook)
        self._mark(initial=True)
        live.register(self.capture)
        rule = config.settings()
        every = rule.shard_replicas
        # a sharded model (its parameters, not a state_dict(): torch's get_state_dict initialises an
        # optimizer's empty state with a step, which changes the run), FTH_SHARD_REPLICAS on: every
        # rank's loop starts here (collective)
        if every and self.replicates and not self.why_not and any(
                sharded.unbacked(p) for m in modules for p in m.parameters()):
            try:
                self.replicas = self.tracker.replicas = ShardReplicas(
                    replicate_every=every, partners=rule.shard_partners, wait=rule.shard_replica_wait)
            except ValueError as e:  # more partners than other ranks
                raise ValueError(f"{config.SHARD_PARTNERS_ENV}={rule.shard_partners}: {e}") from None

    def _replicate(self, step: int) -> None:
        """A step completed (after ``_mark``): this rank's shard to its partners (every n-th step)."""
        if self.replicas is not None and not step % self.replicas.replicate_every:
            try:
                captured = self.capture()
                self.replicas.step(captured.state, step, captured.rng)
            except live.NotLive:  # its state is not that of a completed step (gradient accumulation)
                pass

    def step_starts(self, step: int) -> None:
        """A step begins: the RNG states as it starts (put back first, after live state was loaded); the
        copy of the step before held by the partners (bounded wait) before this step's collectives."""
        if self.tracker is not None:
            live.restore_rng(step)
            self.tracker.start_step(step)
        replicas = self.replicas
        if replicas is not None:
            if (self.tracker is not None and replicas.taken == step
                    and not rng_state.same(replicas.rng, self.tracker.rng_after(step))):
                self._replicate(step)  # the loader drew from torch's RNG (an epoch's start): again, with the RNG now
            replicas.wait_home()

    def failed(self) -> None:
        if self.tracker is not None:
            live.capture_now(self.capture)

    def close(self) -> None:
        replicas, self.replicas = self.replicas, None
        if replicas is not None:  # the loop ended (every rank's): the partners told, the threads joined
            replicas.stop()
        live.unregister(self.capture)
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def _tracked(self, idle: str) -> live.StepTracker:
        tracker = self.tracker
        if tracker is None:
            raise live.NotLive(idle)
        if self.why_not:
            raise live.NotLive(self.why_not)
        tracker.check(self.unit)
        return tracker

    @staticmethod
    def hyper(optimizer: Any) -> list[dict]:
        """An optimizer's param groups without their parameters (what a step's end records)."""
        return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]

    @staticmethod
    def with_hyper(saved: Any, hyper: list[dict]) -> Any:
        if isinstance(saved, dict) and isinstance(saved.get("param_groups"), list):
            saved["param_groups"] = [{**group, **h} for group, h in zip(saved["param_groups"], hyper)]
        return saved


class LoopRecovery:
    """One adapter's part of a recovery in place (:mod:`..core.recoveries`): the loops it was attached
    to, by attempt (``loops``, per framework), and the failed attempt's last completed step."""

    loops: weakref.WeakKeyDictionary
    last_completed: int | None = None  #: the failed attempt's, set at its failure (per framework)
    completed: int | None = None  #: this loop's last completed step

    def attached(self, loop: Any) -> None:
        type(self).loops[loop] = attempts.in_place()

    def carried_on(self, step: int) -> recoveries.RecoveryInfo | None:
        """The next attempt's loop starts at ``step``: the recovery's ``RECOVERED`` (``None``: no recovery)."""
        cls = type(self)
        info = recoveries.carried_on(step, cls.last_completed)
        if info is not None:
            cls.last_completed = None
        return info

    @classmethod
    def tell_failed_loops(cls, info: recoveries.RecoveryInfo, call: Callable[[Any], None], what: str) -> None:
        """``call(loop)`` for each loop of the failed attempt; an exception is logged, never passed on."""
        for loop in [loop for loop, attempt in list(cls.loops.items()) if attempt == info.attempt - 1]:
            try:
                call(loop)
            except Exception as err:  # noqa: BLE001
                log(logging.WARNING, "a %s failed: %s: %s", what, type(err).__name__, first_line(err))

