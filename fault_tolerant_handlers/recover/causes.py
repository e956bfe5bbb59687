"""What recovering in place agrees on: each rank's view of a failure (:class:`Cause`), each rank's
live state (:class:`LiveReport`) and rank 0's :class:`Decision` (with its :class:`LivePlan`), as
bounded JSON in the first attempt's store (checked on read, never unpickled), and the keys they
live under."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..core import attempts
from ..core.kinds import FailureKind
from ..core.records import cap_head, sanitize

#: Declared kinds that end the job as without recovery: a process or host gone, or signalled.
NOT_IN_PLACE = {
    FailureKind.PEER_LOST: "a rank was lost (its process or host is gone): a relaunch replaces it",
    FailureKind.PEER_SILENT: "a rank went silent (its host or network may be gone): a relaunch replaces it",
    FailureKind.RANK_SIGNALLED: "a rank was sent a signal that ends the job",
}
#: A cause read back from the store larger than this (bytes) is ignored.
MAX_CAUSE_BYTES = 8 * 1024
#: Key namespace of the recoveries in the first attempt's store.
KEY_ROOT = "fth/recover"


@dataclass(frozen=True)
class Cause:
    """What one rank knows of an attempt's failure (JSON in the store, bounded and checked on read)."""

    by: int  #: the rank that says it
    failed_rank: int  #: the rank that failed first (-1: unknown)
    exc_type: str
    message: str
    where: str
    step: int  #: -1: unknown
    own: bool  #: ``by`` failed itself
    not_in_place: str  #: why this failure cannot be recovered in place ("" when it can)
    kind: str = ""  #: a FailureKind's value ("": read from exc_type, see failure_kind)

    @property
    def failure_kind(self) -> FailureKind:
        """The kind: as given, else a declared failure's ``exc_type`` (``RankReplaced``), else ``RAISED``."""
        if self.kind:
            try:
                return FailureKind(self.kind)
            except ValueError:
                pass
        return FailureKind.of(self.exc_type, "declared")

    def describe(self) -> str:
        who = f"rank {self.failed_rank}" if self.failed_rank >= 0 else "a rank"
        where = f" in {self.where}" if self.where else ""
        return f"{who} failed{where}: {self.exc_type}: {self.message.splitlines()[0] if self.message else ''}".rstrip(": ")

    def signature(self) -> tuple:
        """Same rank, same exception type, same iteration: the failure repeats."""
        return (self.failed_rank, self.exc_type, self.step)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes, world_size: int) -> Cause | None:
        if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_CAUSE_BYTES:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
            cause = cls(by=int(data["by"]), failed_rank=int(data["failed_rank"]), exc_type=str(data["exc_type"]),
                        message=str(data["message"]), where=str(data["where"]), step=int(data["step"]),
                        own=bool(data["own"]), not_in_place=str(data["not_in_place"]), kind=str(data.get("kind", "")))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None
        if not (0 <= cause.by < world_size and -1 <= cause.failed_rank < world_size and -1 <= cause.step < 2**53):
            return None
        return cls(cause.by, cause.failed_rank, cap_head(sanitize(cause.exc_type), 200),
                   cap_head(sanitize(cause.message), 500), cap_head(sanitize(cause.where), 300), cause.step,
                   cause.own, cap_head(sanitize(cause.not_in_place), 300),
                   cause.kind if cause.kind in {k.value for k in FailureKind} else "")


@dataclass(frozen=True)
class LiveReport:
    """What one rank holds for the next attempt: its live state at step ``step`` (-1: none, ``why``)."""

    by: int  #: the rank that says it
    step: int  #: the last step it completed, whose state it holds (-1: none)
    unit: str  #: "iteration" (Ignite), "global step" (Lightning), "" (none)
    why: str  #: why it holds none ("" when it does)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes, world_size: int) -> LiveReport | None:
        if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_CAUSE_BYTES:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
            report = cls(by=int(data["by"]), step=int(data["step"]), unit=str(data["unit"]), why=str(data["why"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None
        if not (0 <= report.by < world_size and -1 <= report.step < 2**53):
            return None
        return cls(report.by, report.step, cap_head(sanitize(report.unit), 40), cap_head(sanitize(report.why), 300))


@dataclass(frozen=True)
class LivePlan:
    """Where the next attempt's state comes from, the same for every rank: live state at ``step``
    (each rank its own), or (``step`` -1) the newest checkpoint, because of ``why``."""

    step: int
    unit: str = ""
    why: str = ""

    def describe(self) -> str:
        if self.step >= 0:
            return f"live state, {self.unit} {self.step} (each rank's own)"
        return f"the newest checkpoint (live state cannot serve: {self.why})"

    @classmethod
    def from_dict(cls, data: Any) -> LivePlan:
        try:
            return cls(int(data["step"]), cap_head(sanitize(str(data["unit"])), 40), cap_head(sanitize(str(data["why"])), 400))
        except (KeyError, TypeError, ValueError):
            return cls(-1, "", "rank 0's plan could not be read")


def plan_live(reports: list[LiveReport | None], world_size: int) -> LivePlan:
    """Rank 0's rule: from which state every rank carries on, given what each holds.

    Live state serves when every rank holds its own at the same step. Otherwise every rank falls
    back to the newest checkpoint, and the plan says why (the first reason found, by rank).

    This is where the transfer of state between ranks plugs in: a rank that holds nothing (its
    process was replaced), whose state is not trusted (it failed inside an optimizer step) or that
    is a step behind its peers falls back today; with a transfer, the plan names a source rank
    and the receivers instead, and the receivers get the state over the re-formed group before
    the next call loads it (:func:`..data.live.take`).
    """
    by_rank = {r.by: r for r in reports if r is not None}
    for rank in range(world_size):
        report = by_rank.get(rank)
        if report is None:
            return LivePlan(-1, "", f"rank {rank}'s report could not be read")
        if report.step < 0:
            return LivePlan(-1, "", f"rank {rank}: {report.why or 'no live state'}")
    steps = {r.step for r in by_rank.values()}
    units = {r.unit for r in by_rank.values()}
    if len(steps) > 1 or len(units) > 1:
        held = ", ".join(f"rank {r.by} at {r.unit} {r.step}" for r in sorted(by_rank.values(), key=lambda r: r.by))
        return LivePlan(-1, "", f"the ranks completed different steps ({held})")
    return LivePlan(steps.pop(), units.pop(), "")


@dataclass(frozen=True)
class Decision:
    """Rank 0's decision, which every rank follows: recover (``restart``) or end, and why; when it
    recovers, where the next attempt's state comes from (``live``: a :class:`LivePlan` as a dict)."""

    restart: bool
    why: str
    cause: dict | None = None
    live: dict | None = None

    def to_json(self) -> str:
        return json.dumps({"restart": self.restart, "why": self.why, "cause": self.cause, "live": self.live})

    @classmethod
    def from_json(cls, raw: bytes) -> Decision | None:
        if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_CAUSE_BYTES:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
            return cls(bool(data["restart"]), cap_head(sanitize(str(data["why"])), 500),
                       data["cause"] if isinstance(data.get("cause"), dict) else None,
                       data["live"] if isinstance(data.get("live"), dict) else None)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None


def _needs_keeper(cause: Cause) -> bool:
    """A peer's process ended (its host lives): recovered in place only by its keeper's replacement."""
    return not cause.own and cause.exc_type == FailureKind.PEER_LOST and not cause.not_in_place


def keeper_key(rank: int) -> str:
    """Set by a keeper's child when its first session starts: rank ``rank`` has a keeper."""
    return f"{KEY_ROOT}/{attempts.restart()}/keeper/{rank}"


def _base_of(store: Any) -> Any:
    """The store under every ``PrefixStore`` of ``store`` (the rendezvous's own)."""
    for _ in range(16):
        under = getattr(store, "underlying_store", None)
        if under is None:
            return store
        store = under
    return store
