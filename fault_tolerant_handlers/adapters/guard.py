"""What both adapters call at their framework's hooks: one :class:`Guard` per training loop (its verbs
drive the loop's :class:`~..core.session.Session`), a loop's live state (:class:`LiveLoop`) and its
part of a recovery in place (:class:`LoopRecovery`)."""

from __future__ import annotations

import logging
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch

from ..core import attempts, config, interrupts, recoveries, sharded
from ..core.hooks import first_line, log
from ..core.sections import check_name
from ..core.failure import tag, tag_of
from ..core.session import Session, get_session
from ..data import live
from ..data.replicas import ShardReplicas
from ..detect.autohang import START, STEP


class Guard:
    """Fail-together verbs for one training loop: the adapters' ``FaultTolerance`` arguments, and
    ``release_on_failure`` (this rank's collectives released at once when it fails), ``owner`` (the
    class named in argument errors)."""

    def __init__(self, *, sync_every: int | None = 100, hang_timeout: timedelta | float | str | dict | None = None,
                 watchdog: bool = True, release_on_failure: bool = True, name: str = "train",
                 owner: str = "FaultTolerance") -> None:
        if sync_every is not None and (isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"{owner}(sync_every=...) must be a positive int (iterations) or None, got {sync_every!r}")
        hang_timeout = config.check_hang_timeout(hang_timeout, what=f"{owner}(hang_timeout=...)")
        if not isinstance(watchdog, bool):
            raise TypeError(f"{owner}(watchdog=...) must be True or False, got {watchdog!r}")
        check_name(owner, name)
        config.load()  # every FTH_* variable is checked now, not when a failure comes
        self.sync_every = sync_every
        self.hang_timeout = hang_timeout
        self.use_watchdog = watchdog
        self.release_on_failure = release_on_failure
        self.name = name
        self.session: Session | None = None
        self._watching = False
        self._explainers: list = []

    @property
    def active(self) -> bool:
        return self.session is not None

    @property
    def _watchdog(self):
        return self.session.watchdog if self.session is not None else None

    def start(self) -> None:
        """Collective on first use: call on every rank before training. A no-op without distribution."""
        self.session = get_session(None, caller=type(self).__name__)
        if self.session is not None and self.use_watchdog and not self._watching:
            self.session.start_watchdog(self.hang_timeout)
            self._watching = True
        self.beat()

    def stop(self) -> None:
        """The loop ended normally on every rank: drop this loop's watchdog reference."""
        if self._watching and self.session is not None:
            auto = self.auto_hang
            if auto is not None:  # this loop's work is over: nothing of it is watched any more
                auto.mark(None, time.monotonic())
                auto.explainers[:] = [e for e in auto.explainers if e not in self._explainers]
            self._explainers = []
            self._watching = False
            self.session.stop_watchdog()

    def beat(self, step: int | None = None, work: str | None = None, *, completed: bool = False) -> None:
        """Progress; ``work``: the kind of work that begins now, ending the one under way (``hang_timeout=
        "auto"``); ``completed``: a batch completed. Raises the interrupt of a hung main thread again if
        user code swallowed it."""
        interrupts.raise_pending()
        watchdog = self._watchdog
        if watchdog is not None:  # a hang report names the step under way: in a training step, the next
            named = step + 1 if step is not None and work in (STEP, START) else None
            watchdog.beat(step, completed=completed, named=named)
            if work is not None and watchdog.auto_hang is not None:
                watchdog.auto_hang.mark(work, time.monotonic(), step if named is None else named)

    @property
    def auto_hang(self):  # the learned-deadline probe of hang_timeout="auto", else None
        return getattr(self._watchdog, "auto_hang", None)

    def explain_with(self, explainer: Callable[[object], tuple[str, object] | None]) -> None:
        """Add a way to recognise work from the main thread's stack (:mod:`..detect.autohang`)."""
        auto = self.auto_hang
        if auto is not None and explainer not in auto.explainers:
            auto.explainers.append(explainer)
            self._explainers.append(explainer)

    def due(self, iteration: int) -> bool:
        return self.sync_every is not None and iteration % self.sync_every == 0

    def check(self, *, step: int | None = None, epoch: int | None = None) -> None:
        """Raise the peer failure the watchdog already knows (no communication), or the interrupt
        of a hung main thread that user code swallowed."""
        interrupts.raise_pending()
        known = self.session.failure.peer_error if self.session is not None else None
        if known is not None:
            raise self.on_exception(known, step=step, epoch=epoch)

    def sync(self, where: str, *, step: int | None = None, epoch: int | None = None) -> None:
        """One agreement at sync point ``where``: raise on every rank if any rank failed."""
        session = self.session
        if session is None:
            return
        self.check(step=step, epoch=epoch)
        err = session.agree("loop", f"{self.name}: {where}", step=step, epoch=epoch)
        if err is not None:
            tag(err, agreed=True)
            raise self.on_exception(err, step=step, epoch=epoch)

    def on_exception(self, exc: BaseException, *, step: int | None = None, epoch: int | None = None) -> BaseException:
        """What this rank must raise for ``exc`` (handled once): ``exc`` itself, a local failure now
        published, or the peer's ``PeerFailedError`` for an error that comes from a peer's failure."""
        session = self.session
        if session is None or tag_of(exc).handled:
            return exc
        if isinstance(exc, SystemExit) and session.failure.signal is not None:
            # the framework's answer to this rank's own SIGTERM: the peers know it already
            tag(exc, handled=True)
            return exc
        peer = session.classify(exc)
        if peer is not None:
            session.acknowledge(peer)
            tag(peer, handled=True)
            if peer is not exc:
                peer.__cause__ = exc
            log(logging.ERROR, "stopping: %s", first_line(peer, None), step=step)
            return peer
        session.report_error(exc, section=self.name, step=step, epoch=epoch, release=self.release_on_failure)
        tag(exc, handled=True)
        return exc


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

    def _refuse(self, why: str) -> None:
        self.why_not = why
        log(logging.WARNING, "live state refused: %s; a recovery in place resumes from the newest checkpoint", why)

    def step_starts(self, step: int) -> None:
        """A step begins: torch's RNG as it starts (put back first, after live state was loaded); the
        copy of the step before held by the partners (bounded wait) before this step's collectives."""
        if self.tracker is not None:
            live.restore_rng(step)
            self.tracker.start_step(step)
        replicas = self.replicas
        if replicas is not None:
            if (self.tracker is not None and replicas.taken == step
                    and not _same_rng(replicas.rng, self.tracker.rng_after(step))):
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

    def failed(self) -> None:
        """The loop failed: what it completed is what the next attempt may compute twice."""
        type(self).last_completed = self.completed

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


def _same_rng(a: tuple | None, b: tuple | None) -> bool:
    """Recorded RNG states (``(cpu, [cuda, ...] or None)``) that are equal, bit for bit."""
    flat = [[t for t in (x[0], *(x[1] or ()))] if x is not None else [] for x in (a, b)]
    return len(flat[0]) == len(flat[1]) and all(torch.equal(s, t) for s, t in zip(*flat))
