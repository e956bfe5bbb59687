"""Live state: after a failure, carry on from the state the surviving processes hold at the step they
last completed, instead of the newest checkpoint (docs/recovering.md, "Live state"): a
:class:`StepTracker` per loop, its capture when it fails (:func:`collect`), and the held state handed
to the next attempt under the name :func:`latest_checkpoint_answer` gives (:func:`take`)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..core import attempts, config, rng_state, sharded
from ..core.hooks import first_line, log
from ..core.phases import LIVE_NAME, Captured, RecoveryState  # a capture travels between ranks: the core's type


class NotLive(Exception):
    """This rank's live state cannot serve; the message says why (for the recovery's log line)."""


def enabled() -> bool:
    """A recovery in place runs here and ``FTH_LIVE_STATE`` is not ``0``."""
    return attempts.recovering() and config.settings().live_state


# -- the optimizer hooks (process-wide, one pair while any tracker lives) --------------------------------
_lock = threading.Lock()
_trackers: list[StepTracker] = []
_hook_handles: list[Any] = []


def _pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    for tracker in _trackers:
        if tracker.update_at_pre_hook:
            tracker.updating = True


def _post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    for tracker in _trackers:
        tracker.updating = False
        tracker.updates += 1


class StepTracker:
    """Per-step bookkeeping of one training loop on its training thread: small state at each step's
    end, the RNG states at each start (:mod:`..core.rng_state`), whether an optimizer update began
    since. ``modules``: whose buffers' versions are compared; ``update_at_pre_hook``: an update begins
    at ``optimizer.step`` (Ignite), else at :meth:`update_begins` (Lightning, whose ``optimizer.step``
    first runs the training step)."""

    def __init__(self, modules: Iterable[torch.nn.Module], *, update_at_pre_hook: bool) -> None:
        self.update_at_pre_hook = update_at_pre_hook
        self.buffers = [b for m in modules for b in m.buffers()]
        self.step = -1  #: the last step completed (-1: none yet)
        self.small: dict[str, Any] = {}  #: small state recorded when it completed
        self.versions = 0
        self.stepped = True  #: an optimizer update ran in the step that completed last
        self.updating = False  #: an optimizer update runs now
        self.updates = 0  #: optimizer updates since the last step completed
        self.rng: tuple | None = None  #: (step it follows, RNG states as read) at the start of a step
        self.replicas: Any = None  #: the loop's ``data.replicas.ShardReplicas`` (its adapter's), if it replicates
        with _lock:
            if not _trackers:
                _hook_handles[:] = [register_optimizer_step_pre_hook(_pre_hook),
                                    register_optimizer_step_post_hook(_post_hook)]
            _trackers.append(self)

    def close(self) -> None:
        """Stop tracking; the optimizer hooks go with the last tracker."""
        with _lock:
            if self in _trackers:
                _trackers.remove(self)
            if not _trackers:
                for handle in _hook_handles:
                    handle.remove()
                _hook_handles.clear()

    def update_begins(self) -> None:
        self.updating = True

    def start_step(self, after: int) -> None:
        self.rng = (after, rng_state.read())

    def complete(self, step: int, small: dict[str, Any], *, initial: bool = False) -> None:
        """Step ``step`` completed (or, ``initial``, the loop starts from it): ``small`` is its small state."""
        self.stepped = initial or self.updates > 0
        self.step, self.small, self.updates, self.updating = step, small, 0, False
        # the next step's RNG until it starts (a failure may come first; the same unless its batch draws from it)
        self.rng = (step, rng_state.read())
        self.versions = sum(b._version for b in self.buffers)

    def check(self, unit: str) -> None:
        """Raise :class:`NotLive` unless the live tensors are still those of step :attr:`step`."""
        if self.step < 0:
            raise NotLive("no step completed in this attempt")
        if self.updating:
            raise NotLive(f"it failed inside the optimizer step of the {unit} after {self.step}: its state is not trusted")
        if self.updates:
            raise NotLive(f"it failed after the optimizer step of the {unit} after {self.step}, before that {unit} "
                          "completed")
        if not self.stepped:
            raise NotLive(f"{unit} {self.step} completed without an optimizer step (gradient accumulation): the "
                          "accumulated gradients are not part of the state")
        if sum(b._version for b in self.buffers) != self.versions:
            raise NotLive(f"the model's buffers changed after {unit} {self.step} (BatchNorm statistics of the failed "
                          "step's forward)")

    def rng_after(self, step: int) -> tuple | None:
        return rng_state.of(self.rng[1]) if self.rng is not None and self.rng[0] == step else None


# -- the capture of the failed attempt ---------------------------------------------------------------------
_capturers: list[Callable[[], Captured]] = []
_captured: Captured | NotLive | None = None
_completed: int | None = None  # the failed attempt's last completed step (its capture's), until forget()


def register(capture: Callable[[], Captured]) -> None:
    """A loop runs: ``capture()`` gives its state (or raises :class:`NotLive`)."""
    if capture not in _capturers:
        _capturers.append(capture)


def unregister(capture: Callable[[], Captured]) -> None:
    if capture in _capturers:
        _capturers.remove(capture)


def capture_now(capture: Callable[[], Captured]) -> None:
    """The loop failed: capture its state before its framework tears anything down (the last kept)."""
    global _captured
    try:
        captured = capture()
        if sharded.find(captured.state) is not None:  # this rank's shard: copied now, checksummed, to the CPU
            rank = dist.get_rank() if dist.is_initialized() else 0
            captured = replace(captured, state=sharded.take_snapshot(captured.state, captured.step, rank))
        _captured = captured
    except NotLive as why:
        _captured = why
    except Exception as err:  # noqa: BLE001 - a capture that fails: the checkpoint serves
        _captured = NotLive(f"capturing it failed: {type(err).__name__}: {first_line(err)}")


def collect() -> Captured:
    """The failed attempt's capture, or :class:`NotLive` saying why none; the registrations end here."""
    global _captured, _completed
    try:
        if not config.settings().live_state:
            raise NotLive(f"{config.LIVE_STATE_ENV}=0")
        if _captured is None and _capturers:
            capture_now(_capturers[-1])
        captured = _captured
    finally:
        _captured = None
        _capturers.clear()
        for tracker in list(_trackers):
            tracker.close()
    if captured is None:
        raise NotLive("no training loop of the library's adapters was running when it failed")
    if isinstance(captured, NotLive):
        raise captured
    _completed = captured.step
    return captured


def capture_live(state: RecoveryState) -> RecoveryState:
    """``CAPTURE_LIVE``: this rank's live state of the failed attempt, or why there is none."""
    copies = replica_copies()  # the replicas stopped first: nothing sent or received from here on
    try:
        return replace(state, live=collect(), live_why="", copies=copies)
    except NotLive as why:
        return replace(state, live=None, live_why=str(why), copies=copies)


def settle_live(state: RecoveryState) -> None:
    """``SETTLE_LIVE``: the next attempt resumes from ``state.live`` (``None``: from what it loads itself)."""
    hold(state.live, getattr(state.plan, "why", "") or "")


def replica_copies() -> tuple:
    """The loop failed: every tracked loop's shard replicas stopped, and the snapshots they hold."""
    return tuple(snap for t in list(_trackers) if t.replicas is not None for snap in t.replicas.abort())


# -- the state the next attempt resumes from ---------------------------------------------------------------
_held: tuple[str, Captured] | None = None  # (the resolved name it answers to, the capture)
_handed: tuple[Captured, str] | None = None  # taken, until the next loop starts: (the capture, how it was loaded)
_fallback: str | None = None  # live state cannot serve this attempt: why (told when its loop starts)
_armed_rng: tuple[int, tuple] | None = None  # (the step it follows, states): restored as that step starts


def _key(path: str | os.PathLike) -> str:
    return str(Path(path).resolve())


def hold(captured: Captured | None, why: str = "") -> None:
    """The next attempt resumes from ``captured`` (``None``: from what it loads, because of ``why``)."""
    global _held, _handed, _fallback
    with _lock:
        _held = None if captured is None else ("", captured)
        _handed = None
        _fallback = None if captured is not None else f"live state could not serve: {why or 'no plan was made'}"


def held() -> Captured | None:
    with _lock:
        return _held[1] if _held is not None else None


def latest_checkpoint_answer(dirname: str | os.PathLike) -> str | None:
    """What ``latest_checkpoint(dirname)`` answers while live state is held, else ``None``."""
    global _held
    with _lock:
        if _held is None:
            return None
        captured = _held[1]
        name = str(Path(dirname) / LIVE_NAME.format(step=captured.step))
        _held = (_key(name), captured)
    return name


def _held_as(path: str | os.PathLike) -> bool:
    return _held is not None and bool(_held[0]) and _key(path) == _held[0]


def newest(path: str | os.PathLike) -> Any | None:
    """The live state for ``path`` (a name :func:`latest_checkpoint_answer` gave), not taken."""
    with _lock:
        return _held[1].state if _held_as(path) else None


def _hand_over(how: str) -> Captured:
    """Under the lock: the held state, handed over once (its RNG armed for :func:`restore_rng`)."""
    global _held, _handed, _armed_rng
    captured, _held = _held[1], None
    _handed = (captured, how)
    _armed_rng = (captured.step, captured.rng) if captured.rng is not None else None
    return captured


def take(path: str | os.PathLike, objects: Iterable[Any] = ()) -> Any | None:
    """The live state for ``path`` (a name :func:`latest_checkpoint_answer` or :func:`substitute` gave),
    handed over once, as ``objects`` load it (:func:`..core.sharded.rebuild`); ``None`` for another path."""
    global _how
    with _lock:
        if not _held_as(path):
            return None
        state = sharded.rebuild(_held[1].state, objects)  # raises before it is handed over
        how, _how = _how, None
        _hand_over(how or f"loaded by the script from {Path(path).name}")
    return state


_how: str | None = None  # how the name :func:`substitute` gave is loaded


def substitute(path: str | os.PathLike | None, what: str) -> str | None:
    """An adapter is about to load ``path`` (``None``: nothing): the held live state's name to load
    instead, else ``None``. ``what``: the loading, for the log."""
    global _held, _how
    with _lock:
        if _held is None or (path is not None and _held_as(path)):
            return None
        captured = _held[1]
        name = str(Path(path).parent if path else Path.cwd()) + os.sep + LIVE_NAME.format(step=captured.step)
        _held = (_key(name), captured)
        _how = f"restored through {what}" + (f", instead of {Path(path).name}, which the script passed" if path else "")
    return name


def loop_starts(unit: str, position: Callable[[], int], restore: Callable[[Any], str] | None,
                why_not: str = "", data: Callable[[], str | None] = lambda: None) -> None:
    """The next attempt's loop starts: tell, once, what it carries on from (``position()``: its step).
    Live state the script did not take is restored by ``restore(state)``, or a WARNING says why not.
    ``data()``: why the loop's data does not resume where it does (a loader that starts its epoch over),
    else ``None``."""
    global _held, _handed, _fallback
    with _lock:
        pending = _hand_over("restored") if _held is not None and restore is not None else None
        unused = _held[1] if _held is not None and restore is None else None
        handed, _handed = (_handed, None) if pending is None else (None, None)
        fallback, _fallback = _fallback, None
    if pending is not None:
        before = position()
        what = restore(pending.state)
        _tell(pending, position(), f"restored into {what}" + (f"; it replaces what the script loaded ({unit} {before})"
                                                              if before else ""), data)
    elif handed is not None:
        _tell(handed[0], position(), handed[1], data)
    elif unused is not None:
        with _lock:
            _held = None
        log(logging.WARNING, "live state of %s %d was not restored: %s; the script did not load it either "
            "(load_checkpoint(latest_checkpoint(...))), so the run starts at %s %d, from what the script loaded",
            unused.unit, unused.step, why_not or "nothing here can restore it", unit, position())
    elif fallback is not None:
        now = position()
        log(logging.WARNING, "this attempt starts at %s %d: %s (%s)", unit, now,
            "from the checkpoint the script loaded" if now else "the script loaded no checkpoint, so from the start",
            fallback)


def _tell(captured: Captured, now: int, how: str, data: Callable[[], str | None]) -> None:
    twice = (_completed or 0) - captured.step  # the agreed step is older than this rank's last (a shard held nowhere)
    if now == captured.step:
        said = [f"{twice} step(s) this rank had completed computed again"] if twice > 0 else []
        if (gap := data()) is not None:
            said.append(f"resumed at that {captured.unit}, but {gap}, not the batches an uninterrupted run trains")
        log(logging.WARNING, "carries on from live state, %s %d (%s): %s", captured.unit, captured.step, how,
            "; ".join(said) or "no step computed twice")
    else:
        log(logging.WARNING, "live state of %s %d was handed over (%s), but the loop starts at %s %d: the script "
            "loaded something else after it", captured.unit, captured.step, how, captured.unit, now)


def restore_rng(after: int) -> bool:
    """The step after ``after`` starts: the RNG states (torch's, Python's ``random``, numpy's global) put
    back as the failed attempt had them, once, if live state of step ``after`` was loaded; whether it was."""
    global _armed_rng
    armed = _armed_rng
    if armed is None:
        return False
    _armed_rng = None
    if armed[0] != after:
        return False
    rng_state.restore(armed[1])
    return True


def forget() -> None:
    """The recovery ends: nothing held or captured any more."""
    global _held, _captured, _armed_rng, _handed, _fallback, _completed
    with _lock:
        _held, _handed, _fallback, _completed = None, None, None, None
    _captured, _armed_rng = None, None
    _capturers.clear()
    replica_copies()
    for tracker in list(_trackers):
        tracker.close()

