"""What recovering in place agrees on: each rank's view of a failure (:class:`Cause`), each rank's
live state (:class:`LiveReport`) and rank 0's :class:`Decision` (with its :class:`LivePlan`), as
bounded JSON in the first attempt's store (checked on read, never unpickled), and the keys they
live under."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..core import attempts
from ..core.failure import FailureKind, cap_head, sanitize

#: Declared kinds that end the job as without recovery: a process or host gone, or signalled.
NOT_IN_PLACE = {
    FailureKind.PEER_LOST: "a rank was lost (its process or host is gone): a relaunch replaces it",
    FailureKind.PEER_SILENT: "a rank went silent (its host or network may be gone): a relaunch replaces it",
    FailureKind.RANK_SIGNALLED: "a rank was sent a signal that ends the job",
    FailureKind.STORE_LOST: "the c10d store was lost (every recovery is agreed on in it), on a host no rank runs on: a "
                            "relaunch with a store that answers resumes",
}
#: A cause read back from the store larger than this (bytes) is ignored.
MAX_CAUSE_BYTES = 8 * 1024
#: Key namespace of the recoveries in the first attempt's store.
KEY_ROOT = "fth/recover"


def read_json(raw: Any) -> Any:
    """The JSON value a store key holds (``None`` if it is not bytes, longer than
    :data:`MAX_CAUSE_BYTES` or not JSON); the readers below check its fields."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) > MAX_CAUSE_BYTES:
        return None
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None


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
        data = read_json(raw)
        try:
            cause = cls(by=int(data["by"]), failed_rank=int(data["failed_rank"]), exc_type=str(data["exc_type"]),
                        message=str(data["message"]), where=str(data["where"]), step=int(data["step"]),
                        own=bool(data["own"]), not_in_place=str(data["not_in_place"]), kind=str(data.get("kind", "")))
        except (ValueError, KeyError, TypeError):
            return None
        if not (0 <= cause.by < world_size and -1 <= cause.failed_rank < world_size and -1 <= cause.step < 2**53):
            return None
        return cls(cause.by, cause.failed_rank, cap_head(sanitize(cause.exc_type), 200),
                   cap_head(sanitize(cause.message), 500), cap_head(sanitize(cause.where), 300), cause.step,
                   cause.own, cap_head(sanitize(cause.not_in_place), 300),
                   cause.kind if cause.kind in {k.value for k in FailureKind} else "")


#: A checksum in a report: :func:`.live_state.checksum`'s hex digest (or "" when none was taken).
_CHECKSUM_CHARS = 64


def _hex(value: Any, chars: int) -> str:
    """``value`` if it is a lower-case hex string of at most ``chars`` characters, else ""."""
    text = str(value)
    return text if len(text) <= chars and all(c in "0123456789abcdef" for c in text) else ""


@dataclass(frozen=True)
class LiveReport:
    """What one rank holds for the next attempt: its live state at step ``step`` (-1: none, ``why``),
    the :func:`.live_state.checksum` of that state ("" if it could not be taken: ``portable`` says
    why it cannot be sent either) and a CRC of torch's RNG states recorded for the next step ("":
    none)."""

    by: int  #: the rank that says it
    step: int  #: the last step it completed, whose state it holds (-1: none)
    unit: str  #: "iteration" (Ignite), "global step" (Lightning), "" (none)
    why: str  #: why it holds none ("" when it does)
    checksum: str = ""  #: hex SHA-256 of the state ("": not taken)
    rng: str = ""  #: hex CRC-32 of the RNG states recorded for the next step ("": none)
    portable: str = ""  #: why this state cannot be sent to another rank ("" when it can)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes, world_size: int) -> LiveReport | None:
        data = read_json(raw)
        try:
            report = cls(by=int(data["by"]), step=int(data["step"]), unit=str(data["unit"]), why=str(data["why"]),
                         checksum=str(data.get("checksum", "")), rng=str(data.get("rng", "")),
                         portable=str(data.get("portable", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        if not (0 <= report.by < world_size and -1 <= report.step < 2**53):
            return None
        return cls(report.by, report.step, cap_head(sanitize(report.unit), 40), cap_head(sanitize(report.why), 300),
                   _hex(report.checksum, _CHECKSUM_CHARS), _hex(report.rng, 8), cap_head(sanitize(report.portable), 300))


@dataclass(frozen=True)
class LivePlan:
    """Where the next attempt's state comes from, the same for every rank: live state at ``step``,
    each rank its own, except ``receivers``, who get ``source``'s over a group the recovery forms
    (``rng_shared``: the source's RNG states too, the holders' being the same); or (``step`` -1) the
    newest checkpoint, because of ``why``."""

    step: int
    unit: str = ""
    why: str = ""
    source: int = -1  #: the rank whose state the receivers get (-1: nobody receives)
    receivers: tuple[int, ...] = ()  #: ranks that get the source's state, each with its reason in ``whom``
    whom: str = ""  #: why each receiver receives, for the log ("rank 1: its process was replaced")
    checksum: str = ""  #: the source's state's checksum ("": not taken), checked by the receivers
    rng_shared: bool = False  #: the receivers take the source's RNG states too

    def describe(self) -> str:
        """The plan, as the recovery's line tells it before the next call: what is held for it (what
        the next attempt really carried on from is told when its loop starts, :func:`..data.live.loop_starts`)."""
        if self.step < 0:
            return ("the next call starts from what it loads itself: the newest checkpoint, or the start if it loads "
                    f"none (live state cannot serve: {self.why})")
        if not self.receivers:
            return f"live state, {self.unit} {self.step} (each rank's own), is held for the next call"
        rng = "its RNG states too" if self.rng_shared else "not its RNG states (the ranks' differ or none were recorded)"
        return (f"live state, {self.unit} {self.step} (each rank's own; sent from rank {self.source} to "
                f"{self.whom}; {rng}), is held for the next call")

    def to_dict(self) -> dict:
        """As JSON holds it (what :meth:`from_dict` reads back)."""
        return {**asdict(self), "receivers": list(self.receivers)}

    @classmethod
    def from_dict(cls, data: Any) -> LivePlan:
        try:
            receivers = tuple(int(r) for r in data.get("receivers", ()))[:4096]
            return cls(int(data["step"]), cap_head(sanitize(str(data["unit"])), 40), cap_head(sanitize(str(data["why"])), 400),
                       int(data.get("source", -1)), receivers, cap_head(sanitize(str(data.get("whom", ""))), 400),
                       _hex(data.get("checksum", ""), _CHECKSUM_CHARS), bool(data.get("rng_shared", False)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return cls(-1, "", "rank 0's plan could not be read")

    def checked(self, world_size: int) -> LivePlan:
        """This plan, or a fallback when its ranks are not ranks of the world (a plan read back from
        the store is checked before any rank acts on it)."""
        if self.step < 0 or not self.receivers:
            return self
        if not (0 <= self.source < world_size and self.source not in self.receivers
                and all(0 <= r < world_size for r in self.receivers)):
            return LivePlan(-1, "", "rank 0's plan names ranks outside the world")
        return self


@dataclass(frozen=True)
class Decision:
    """Rank 0's decision, which every rank follows: recover (``restart``) or end, and why; when it
    recovers, where the next attempt's state comes from (``live``: a :class:`LivePlan` as a dict)."""

    restart: bool
    why: str
    cause: dict | None = None
    live: dict | None = None
    spares_left: int = -1  #: with spares, how many are left after this recovery (-1: no spares)

    def to_json(self) -> str:
        return json.dumps({"restart": self.restart, "why": self.why, "cause": self.cause, "live": self.live,
                           "spares_left": self.spares_left})

    @classmethod
    def from_json(cls, raw: bytes) -> Decision | None:
        data = read_json(raw)
        try:
            left = int(data.get("spares_left", -1))
            return cls(bool(data["restart"]), cap_head(sanitize(str(data["why"])), 500),
                       data["cause"] if isinstance(data.get("cause"), dict) else None,
                       data["live"] if isinstance(data.get("live"), dict) else None,
                       left if -1 <= left < 2**31 else -1)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def needs_keeper(cause: Cause) -> bool:
    """A peer's process ended (its host lives): recovered in place only by its keeper's replacement."""
    return not cause.own and cause.exc_type == FailureKind.PEER_LOST and not cause.not_in_place


def keeper_key(rank: int) -> str:
    """Set by a keeper's child when its first session starts: rank ``rank`` has a keeper."""
    return f"{KEY_ROOT}/{attempts.restart()}/keeper/{rank}"


def keeper_replaces(store: Any, rank: int, end_seen: bool) -> bool:
    """A keeper replaces lost rank ``rank``: its end was seen (by a peer on its host, or its liveness
    helper, which saw its keeper live on) and its keeper announced itself (:func:`keeper_key`). A key
    alone is no evidence: a rank whose host is gone or cut off left its key behind, announced when it
    started, and so did a keeper killed with its rank."""
    return end_seen and bool(store.check([keeper_key(rank)]))


def base_of(store: Any) -> Any:
    """The store under every ``PrefixStore`` of ``store`` (the rendezvous's own)."""
    for _ in range(16):
        under = getattr(store, "underlying_store", None)
        if under is None:
            return store
        store = under
    return store
