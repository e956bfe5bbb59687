"""A hang deadline learned from the run itself (``hang_timeout="auto"``, ``docs/hang-detection.md``), as
a watchdog probe.

The main thread marks where each piece of work begins (:meth:`AutoHangProbe.mark`); a mark ends the
piece under way. A kind's deadline is ``max(floor, multiple x longest seen)`` (a kind not seen yet
borrows the longest of any kind, times ``first_multiple``); nothing is judged until ``warmup`` steps
have finished. Past the deadline, the main thread's stack decides:

- waiting in a collective or a backward pass (:func:`~.probes.waiting_on_peers`): **never** a hang
  of this rank (the rank it waits for judges itself; a dead peer is the liveness probes' to find);
  the piece is judged again from when it was last seen waiting, and such a wait is not learned;
- in a debugger: not a hang;
- an *explainer* recognises the work (``explain(frame) -> (kind, token) | None``): judged again as
  that kind, from now, and again each time ``token`` moves;
- otherwise the rank is hung: a ``RankHung`` finding with the main thread's stack.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable

from ..core import config
from ..core.errors import PeerFailedError
from .probes import hung_error, waiting_on_peers
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


class AutoHangProbe:
    """This rank's main thread stuck in a piece of work far longer than any like it so far."""

    def __init__(self, rank: int, pid: int, *, frame: Callable[[], object], multiple: float = DEFAULT_MULTIPLE,
                 first_multiple: float = DEFAULT_FIRST_MULTIPLE, floor: float = DEFAULT_FLOOR,
                 warmup: int = DEFAULT_WARMUP, wall: Callable[[], float] = time.time,
                 explain: Iterable[Explainer] = (), host: str = "") -> None:
        # (the FTH_AUTO_HANG_* ranges are checked where the settings are read)
        self.rank = rank
        self.pid = pid
        self.frame = frame
        self.multiple = multiple
        self.first_multiple = first_multiple
        self.floor = floor
        self.warmup = warmup
        self.wall = wall
        self.host = host  # this rank's host name, for the report
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
        """End the piece of work under way (its duration is learned) and begin ``kind`` (``None``:
        nothing is watched until the next mark)."""
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


def from_config(rank: int, pid: int, frame: Callable[[], object], host: str = "") -> AutoHangProbe:
    rule = config.settings()
    return AutoHangProbe(rank, pid, frame=frame, multiple=rule.auto_hang_multiple, floor=rule.auto_hang_floor,
                         warmup=rule.auto_hang_warmup, explain=[writing_checkpoint_explainer], host=host)
