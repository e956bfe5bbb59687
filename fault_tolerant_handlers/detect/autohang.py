"""The hang probes of the watchdog thread (``docs/hang-detection.md``): a fixed deadline
(:class:`SelfHangProbe`, ``hang_timeout=...``) and one learned from the run (:class:`AutoHangProbe`,
``hang_timeout="auto"``). A rank waiting on its peers is never hung itself: the one it waits for judges itself.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Callable, Iterable

from ..core import config
from ..core.failure import MAX_TRACEBACK_CHARS, FailureKind, FailureRecord, PeerFailedError, cap_tail
from .writes import writing_now

#: Defaults of the rule (``FTH_AUTO_HANG_MULTIPLE``, ``_FLOOR_SEC``, ``_WARMUP`` override the first three).
DEFAULT_MULTIPLE, DEFAULT_FLOOR, DEFAULT_WARMUP = (config.SETTINGS[i].default for i in (3, 4, 5))
DEFAULT_FIRST_MULTIPLE = 10.0

#: The kinds of work the adapters mark (``START``: a loop's start, before its first step).
START = "start"
STEP = "step"
EVALUATION = "evaluation"
CHECKPOINT = "checkpoint"

Explainer = Callable[[object], "tuple[str, object] | None"]

_WAITING = object()  # the token of a piece seen waiting for its peers

_DEBUGGERS = (f"{os.sep}bdb.py", f"{os.sep}pdb.py")

#: Where a main thread waits for its peers rather than being hung itself (innermost frames).
WAITING_MARKERS = (
    f"torch{os.sep}distributed{os.sep}",
    f"torch{os.sep}nn{os.sep}parallel{os.sep}",
    f"torch{os.sep}autograd{os.sep}",
    f"torch{os.sep}_tensor.py",
    f"fault_tolerant_handlers{os.sep}core{os.sep}session.py",
    f"fault_tolerant_handlers{os.sep}core{os.sep}sections.py",
    f"ignite{os.sep}distributed{os.sep}",
)


def waiting_on_peers(frame) -> bool:
    """True when the innermost Python frames are a collective or a backward pass (DDP all_reduce)."""
    depth = 0
    while frame is not None and depth < 4:
        if any(marker in frame.f_code.co_filename for marker in WAITING_MARKERS):
            return True
        frame = frame.f_back
        depth += 1
    return False


def hung_error(rank: int, pid: int, host: str, frame, what: str, time_ms: int, step: int | None) -> PeerFailedError:
    """This rank declares itself hung (``rank 1 (pid 42 on node-b) hung: {what}``), with its stack from ``frame``."""
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(main thread stack unavailable)\n"
    who = f"rank {rank} (pid {pid} on {host})" if host else f"rank {rank}"
    record = FailureRecord.declared(
        rank=rank, kind=FailureKind.RANK_HUNG, message=f"{who} hung: {what}", by=rank, pid=pid, host=host,
        traceback=f"Main thread stack of rank {rank}:\n{cap_tail(stack, MAX_TRACEBACK_CHARS - 40)}",
        time_ms=time_ms, step=step)
    return PeerFailedError(record=record)


class Unobserved:
    """Time the watchdog thread could not look: each wake-up from its wait of ``period`` that came
    more than :data:`~..core.config.OBSERVED_GAP` periods after it began (the process stopped by SIGSTOP,
    its job suspended, its VM paused, its CPU starved), past the period. The hang probes leave it out
    of a piece's time: the main thread could not run either, so it is no evidence of a hang (a
    heartbeat's silence counts only observed time by the same rule)."""

    def __init__(self) -> None:
        self.seconds = 0.0  # written by the watchdog thread only

    def waited(self, took: float, period: float) -> None:
        if took > config.OBSERVED_GAP * period:
            self.seconds += took - period


class SelfHangProbe:
    """No progress (``progress()``: monotonic time, wall time and step of the last beat) for
    ``hang_timeout`` (``start_timeout`` until ``warm()``), out of a wait on peers: ``RankHung``. Time
    seen waiting is not held against it, but a wait of ``2 x limit + margin`` is declared all the
    same (no rank declared itself: one stuck in C holding the GIL)."""

    def __init__(self, rank: int, pid: int, hang_timeout: float, *, margin: float,
                 progress: Callable[[], tuple[float, float, int | None]], frame: Callable[[], object],
                 host: str = "", start_timeout: float | None = None, warm: Callable[[], bool] = lambda: True,
                 unobserved: Unobserved | None = None) -> None:
        self.rank, self.pid, self.host = rank, pid, host
        #: progress()'s monotonic time leaves it out too (``Watchdog.beat``)
        self.unobserved = unobserved or Unobserved()
        self.hang_timeout = hang_timeout
        self.start_timeout = hang_timeout if start_timeout is None else start_timeout
        self.warm, self.margin, self.progress, self.frame = warm, margin, progress, frame
        self._waited: tuple[tuple, float] | None = None  # (the progress then, when) last seen waiting on peers

    def poll(self, now: float) -> PeerFailedError | None:
        now -= self.unobserved.seconds
        progress = self.progress()
        last, last_wall, step = progress
        warm = self.warm()
        limit = self.hang_timeout if warm else self.start_timeout
        stalled = now - last
        frame = self.frame()
        if waiting_on_peers(frame):
            self._waited = (progress, now)
            if stalled < 2 * limit + self.margin:
                return None
        elif now - (self._waited[1] if self._waited is not None and self._waited[0] is progress else last) < limit:
            return None
        at = f" at step {step}" if step is not None else ""
        before = "" if warm else " before its first iteration completed (the start's deadline)"
        return hung_error(self.rank, self.pid, self.host, frame, f"its main thread made no progress for "
                          f"{stalled:.1f} s{at}{before}", int(last_wall * 1000), step)


class AutoHangProbe:
    """This rank's main thread stuck in a piece of work far longer than any like it so far: the main
    thread marks where each piece begins (:meth:`mark`); a kind's deadline is ``max(floor, multiple x
    longest seen)`` after ``warmup`` steps. Past it, a wait on peers or a debugger is no hang, an
    explainer (``explain(frame) -> (kind, token) | None``) judges the work again as its kind, from
    now and each time ``token`` moves; otherwise ``RankHung``."""

    def __init__(self, rank: int, pid: int, *, frame: Callable[[], object], multiple: float = DEFAULT_MULTIPLE,
                 first_multiple: float = DEFAULT_FIRST_MULTIPLE, floor: float = DEFAULT_FLOOR,
                 warmup: int = DEFAULT_WARMUP, wall: Callable[[], float] = time.time,
                 explain: Iterable[Explainer] = (), host: str = "", unobserved: Unobserved | None = None) -> None:
        self.rank, self.pid, self.host, self.frame = rank, pid, host, frame
        self.unobserved = unobserved or Unobserved()  # left out of every time below
        self.multiple, self.first_multiple, self.floor, self.warmup = multiple, first_multiple, floor, warmup
        self.wall = wall
        #: Recognise work from the main thread's stack (called on the watchdog thread, past a deadline).
        self.explainers: list[Explainer] = list(explain)
        self.longest: dict[str, float] = {}
        self.longest_any = 0.0
        self.steps = 0
        self.current: tuple[str, float, int | None] | None = None  # (kind, started at, step)
        # written by the watchdog thread only: (piece it applies to, kind, token, judged from, kind
        # its duration is learned as, None: not learned)
        self._explained: tuple[tuple, str, object, float, str | None] | None = None
        self._waited: tuple[tuple, float] | None = None  # (piece, when) last seen waiting before its deadline

    # -- fed by the main thread -------------------------------------------------------------------
    def mark(self, kind: str | None, now: float, step: int | None = None) -> None:
        """End the piece of work under way (its duration is learned) and begin ``kind`` (``None``: nothing)."""
        now -= self.unobserved.seconds
        current = self.current
        self.current = None if kind is None else (kind, now, step)
        if current is not None:
            done = learned = current[0]
            seconds = now - current[1]
            explained = self._explained
            if explained is not None and explained[0] is current:
                # a checkpoint or evaluation within a step is not a step's duration; a piece that
                # waited for its peers past its deadline measured them, not itself: not learned
                learned = explained[4]
            if learned is not None and seconds > self.longest.get(learned, -1.0):
                self.longest[learned] = seconds
                if seconds > self.longest_any:
                    self.longest_any = seconds
            if done == STEP:
                self.steps += 1

    # -- the rule ---------------------------------------------------------------------------------
    @property
    def warm(self) -> bool:
        return self.steps >= self.warmup

    def deadline(self, kind: str) -> float | None:
        """Seconds the work ``kind`` may take; ``None`` during the warm-up."""
        if not self.warm:
            return None
        seen = self.longest.get(kind)
        if seen is not None:
            return max(self.floor, self.multiple * seen)
        return max(self.floor, self.multiple * self.first_multiple * self.longest_any)

    def _explain(self, frame) -> tuple[str, object] | None:
        for explainer in list(self.explainers):
            try:
                found = explainer(frame)
            except Exception:  # noqa: BLE001 - a frame that changed under us: no explanation
                found = None
            if found is not None:
                return found
        return None

    def poll(self, now: float) -> PeerFailedError | None:
        now -= self.unobserved.seconds
        current = self.current
        if current is None:
            return None
        kind, start, step = current
        limit = self.deadline(kind)
        if limit is None:
            return None
        frame = self.frame()
        if now - start < limit:
            if waiting_on_peers(frame):  # a wait that ends before the deadline is not held against it either
                self._waited = (current, now)
            return None
        explained = self._explained if self._explained is not None and self._explained[0] is current else None
        if explained is not None:
            explained_limit = self.deadline(explained[1])
            if now - explained[3] < explained_limit:
                return None
        learn_as = explained[4] if explained is not None else kind
        if waiting_on_peers(frame) or in_debugger(frame):
            # not this rank's hang; once it goes on, the piece gets its own deadline again, from the
            # last time it was seen waiting (time spent waiting is not held against it)
            if learn_as == kind:
                learn_as = None
            self._explained = (current, kind, _WAITING, now, learn_as)
            return None
        waited = self._waited
        if explained is None and waited is not None and waited[0] is current and now - waited[1] < limit:
            return None
        found = self._explain(frame)
        if found is None and explained is not None:
            found = (kind, None)  # the recognised work (or the wait) is over: the piece's own deadline, from now
        if found is not None:
            if explained is None or (found[0], found[1]) != (explained[1], explained[2]):
                if found[0] != kind:
                    learn_as = found[0]
                self._explained = (current, found[0], found[1], now, learn_as)  # recognised, or progress
                return None
            what = f"its {found[0]}" + (f" (within a {kind})" if found[0] != kind else "")
            stalled, limit, longest = now - explained[3], explained_limit, self.longest.get(found[0], 0.0)
            lead = f"no progress for {stalled:.1f} s"
            longest_of = found[0]
        else:
            what, stalled, longest, longest_of = f"its {kind}", now - start, self.longest.get(kind, 0.0), kind
            lead = f"has run {stalled:.1f} s"
        at = f" at step {step}" if step is not None else ""
        return hung_error(self.rank, self.pid, self.host, frame, f"{what}{at} {lead}, over the learned deadline of "
                            f"{limit:.1f} s (longest {longest_of} so far: {longest:.2f} s)",
                            int((self.wall() - stalled) * 1000), step)


def in_debugger(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.endswith(_DEBUGGERS):
            return True
        frame = frame.f_back
    return False


def writing_checkpoint_explainer(frame) -> tuple[str, object] | None:
    """A checkpoint being written (one :func:`~.writes.writing_now` sees) is judged as a ``"checkpoint"``."""
    return (CHECKPOINT, None) if writing_now(frame) else None


def from_config(rank: int, pid: int, frame: Callable[[], object], host: str = "",
                unobserved: Unobserved | None = None) -> AutoHangProbe:
    rule = config.settings()
    return AutoHangProbe(rank, pid, frame=frame, multiple=rule.auto_hang_multiple, floor=rule.auto_hang_floor,
                         warmup=rule.auto_hang_warmup, explain=[writing_checkpoint_explainer], host=host,
                         unobserved=unobserved)
