"""A hang deadline learned from the run itself, as a watchdog probe (``poll(now) -> Finding | None``).

The rule, per kind of work (``"step"``, ``"evaluation"``, ``"checkpoint"``, or any other name):

* every finished piece of work reports its duration (:meth:`AutoHangProbe.finished`), and the
  probe keeps the **longest** duration seen per kind;
* the deadline of a kind is ``max(floor, multiple x longest of that kind)``; a kind never seen
  yet borrows the longest of any kind, times ``first_multiple`` on top (an evaluation can be much
  longer than a step: its first run gets a wide margin, later ones the learned one);
* nothing is reported during the **warm-up**: until ``warmup`` steps have finished (the first
  steps include compilation, DataLoader start-up and caches warming);
* the main thread is hung when the work under way (:meth:`AutoHangProbe.started`) has run longer
  than its deadline and the main thread is not merely waiting in a collective (then the hung rank
  is the peer, which reports itself): a ``RankHung`` finding with the main thread's stack, like
  :class:`~.probes.SelfHangProbe`.

It starts no thread and reads the time from its caller, so a unit test drives it with a fake clock.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable

from .errors import PeerFailedError
from .probes import Finding, waiting_on_peers
from .record import MAX_TRACEBACK_CHARS, FailureRecord, cap_tail

#: Defaults of the rule (seconds, counts); each is an argument of :class:`AutoHangProbe`.
DEFAULT_MULTIPLE = 10.0
DEFAULT_FIRST_MULTIPLE = 10.0
DEFAULT_FLOOR = 60.0
DEFAULT_WARMUP = 20


class AutoHangProbe:
    """This rank's main thread stuck in a piece of work far longer than any like it so far."""

    def __init__(self, rank: int, pid: int, *, frame: Callable[[], object], multiple: float = DEFAULT_MULTIPLE,
                 first_multiple: float = DEFAULT_FIRST_MULTIPLE, floor: float = DEFAULT_FLOOR,
                 warmup: int = DEFAULT_WARMUP, wall: Callable[[], float] = time.time) -> None:
        for name, value, low in (("multiple", multiple, 1.0), ("first_multiple", first_multiple, 1.0),
                                 ("floor", floor, 0.0)):
            if not value >= low:
                raise ValueError(f"{name} must be >= {low:g}, got {value!r}")
        if not (isinstance(warmup, int) and warmup >= 1):
            raise ValueError(f"warmup must be an int >= 1 (finished steps), got {warmup!r}")
        self.rank = rank
        self.pid = pid
        self.frame = frame
        self.multiple = multiple
        self.first_multiple = first_multiple
        self.floor = floor
        self.warmup = warmup
        self.wall = wall
        self.longest: dict[str, float] = {}
        self.steps = 0
        self.current: tuple[str, float, int | None] | None = None  # (kind, started at, step)

    # -- fed by the main thread -------------------------------------------------------------------
    def started(self, kind: str, now: float, step: int | None = None) -> None:
        self.current = (kind, now, step)

    def finished(self, now: float) -> None:
        if self.current is None:
            return
        kind, start, _ = self.current
        self.current = None
        self.longest[kind] = max(self.longest.get(kind, 0.0), now - start)
        if kind == "step":
            self.steps += 1

    # -- the rule ---------------------------------------------------------------------------------
    def deadline(self, kind: str) -> float | None:
        """Seconds the work ``kind`` may take; ``None`` during the warm-up."""
        if self.steps < self.warmup:
            return None
        if kind in self.longest:
            return max(self.floor, self.multiple * self.longest[kind])
        return max(self.floor, self.multiple * self.first_multiple * max(self.longest.values()))

    def poll(self, now: float) -> Finding | None:
        if self.current is None:
            return None
        kind, start, step = self.current
        limit = self.deadline(kind)
        stalled = now - start
        if limit is None or stalled < limit:
            return None
        frame = self.frame()
        if stalled < 2 * limit and waiting_on_peers(frame):
            return None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(main thread stack unavailable)\n"
        at = f" at step {step}" if step is not None else ""
        message = (f"rank {self.rank} hung: its {kind}{at} has run {stalled:.1f} s, over the learned deadline of "
                   f"{limit:.1f} s (longest {kind} so far: {self.longest.get(kind, 0.0):.2f} s)")
        record = FailureRecord.declared(
            rank=self.rank, kind="RankHung", message=message, by=self.rank, pid=self.pid,
            traceback=f"Main thread stack of rank {self.rank}:\n{cap_tail(stack, MAX_TRACEBACK_CHARS - 40)}",
            time_ms=int((self.wall() - stalled) * 1000), step=step,
        )
        return Finding(PeerFailedError.from_records([record]), declare=record, hung_self=True)
