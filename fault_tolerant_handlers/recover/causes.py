"""What recovering in place agrees on: each rank's view of a failure (the public
:class:`~..core.recoveries.RecoveryCause`), each rank's live state (:class:`LiveReport`) and rank 0's
:class:`Decision` (with its :class:`LivePlan`), as bounded JSON in the first attempt's store (the one
codec, :class:`~..core.failure.Stored`: checked on read, never unpickled), and the keys they live
under (:mod:`..core.schema`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.schema import keeper_key
from ..core.failure import WORLD, FailureKind, Stored
from ..core.recoveries import RecoveryCause

#: Declared kinds that end the job as without recovery: a process or host gone, or signalled.
NOT_IN_PLACE = {
    FailureKind.PEER_LOST: "a rank was lost (its process or host is gone): a relaunch replaces it",
    FailureKind.PEER_SILENT: "a rank went silent (its host or network may be gone): a relaunch replaces it",
    FailureKind.RANK_SIGNALLED: "a rank was sent a signal that ends the job",
    FailureKind.STORE_LOST: "the c10d store was lost (every recovery is agreed on in it), on a host no rank runs on: a "
                            "relaunch with a store that answers resumes",
}


def brief(cause: RecoveryCause) -> str:
    """``rank 1 failed in train: ValueError: bad``: a cause as the recovery's lines and decisions tell it."""
    who = f"rank {cause.rank}" if cause.rank is not None else "a rank"
    where = f" in {cause.where}" if cause.where else ""
    return f"{who} failed{where}: {cause.exc_type}: {cause.message.splitlines()[0] if cause.message else ''}".rstrip(": ")


def replaced(rank: int, message: str) -> RecoveryCause:
    """The cause a replacement of rank ``rank`` (a keeper's new child, a spare) joins its peers' recovery with."""
    return RecoveryCause(rank, FailureKind.RANK_REPLACED, FailureKind.RANK_REPLACED.value, message, own=True)


def triples(flat: tuple[int, ...], world: int = 2**31, ranks: int = 1) -> list[tuple[int, int, int]] | None:
    """``flat`` as (rank, step or holder, CRC-32) triples; ``None`` unless the first ``ranks`` of each
    are ranks of ``world`` and the last is a CRC-32 (a report or a plan read back from the store)."""
    out = list(zip(flat[::3], flat[1::3], flat[2::3]))
    fits = all(0 <= t[i] < world for t in out for i in range(ranks)) and all(0 <= t[2] < 2**32 for t in out)
    return out if fits and len(flat) % 3 == 0 else None


#: Shard copies a report lists at most (the newest first).
MAX_COPIES = 64
#: A checksum in a report: :func:`.live_state.checksum`'s hex digest (or "" when none was taken).
_CHECKSUM_CHARS = 64


@dataclass(frozen=True)
class LiveReport(Stored):
    """What one rank holds for the next attempt. With ``shard``, ``checksum`` is its snapshot's CRC-32
    (verified where it is held); ``copies`` are checksum verified (:class:`~..data.replicas.ShardReplicas`)."""

    by: int  #: the rank that says it
    step: int  #: the last step it completed, whose state it holds (-1: none)
    unit: str  #: "iteration" (Ignite), "global step" (Lightning), "" (none)
    why: str  #: why it holds none ("" when it does)
    checksum: str = ""  #: hex SHA-256 of the state ("": not taken)
    rng: str = ""  #: hex CRC-32 of the RNG states recorded for the next step ("": none)
    portable: str = ""  #: why this state cannot be sent to another rank ("" when it can)
    shard: bool = False  #: a sharded model's: this rank's own shard
    copies: tuple[int, ...] = ()  #: shard snapshots held here: (rank, step, CRC-32) triples

    BOUNDS: ClassVar[dict] = {"by": (0, WORLD), "step": (-1, 2**53 - 1), "unit": 40, "why": 300,
                              "checksum": ("hex", _CHECKSUM_CHARS), "rng": ("hex", 8), "portable": 300,
                              "copies": (0, 2**53 - 1, 3 * MAX_COPIES)}

    def problem(self, world: int) -> str | None:
        return None if triples(self.copies, world) is not None else "field 'copies' is not (rank, step, CRC-32) triples"


@dataclass(frozen=True)
class LivePlan:
    """Where the next attempt's state comes from, the same for every rank: live state at ``step``, each
    rank its own but the ``receivers``; or (``step`` -1) the newest checkpoint, because of ``why``."""

    step: int
    unit: str = ""
    why: str = ""
    source: int = -1  #: the rank whose state the receivers get (-1: nobody receives)
    receivers: tuple[int, ...] = ()  #: ranks that get the source's state, each with its reason in ``whom``
    whom: str = ""  #: why each receiver receives, for the log ("rank 1: its process was replaced")
    checksum: str = ""  #: the source's state's checksum ("": not taken), checked by the receivers
    rng_shared: bool = False  #: the receivers take the source's RNG states too
    #: a sharded model's shards not resumed from their rank's own capture: (rank, holder, CRC-32)
    #: triples; the holder sends its copy (itself: its own older snapshot), the rank checks its CRC
    shards: tuple[int, ...] = ()

    BOUNDS: ClassVar[dict] = {"step": (-1, 2**53 - 1), "unit": 40, "why": 400, "source": (-1, WORLD),
                              "receivers": (0, WORLD, 4096), "whom": 400, "checksum": ("hex", _CHECKSUM_CHARS),
                              "shards": (0, 2**32 - 1, 3 * 4096)}

    def describe(self) -> str:
        """The plan, as the recovery's line tells it before the next call: what is held for it (what
        the next attempt really carried on from is told when its loop starts, :func:`..data.live.loop_starts`)."""
        if self.step < 0:
            return ("the next call starts from what it loads itself: the newest checkpoint, or the start if it loads "
                    f"none (live state cannot serve: {self.why})")
        if self.shards:
            return f"live state, {self.unit} {self.step} ({self.whom}), is held for the next call"
        if not self.receivers:
            return f"live state, {self.unit} {self.step} (each rank's own), is held for the next call"
        rng = "its RNG states too" if self.rng_shared else "not its RNG states (the ranks' differ or none were recorded)"
        return (f"live state, {self.unit} {self.step} (each rank's own; sent from rank {self.source} to "
                f"{self.whom}; {rng}), is held for the next call")

    def checked(self, world_size: int) -> LivePlan:
        """This plan, or a fallback when its ranks are not ranks of the world (a plan read back from
        the store is checked before any rank acts on it)."""
        ranks = self.receivers + ((self.source,) if self.receivers else ())
        if self.step >= 0 and (triples(self.shards, world_size, 2) is None or self.source in self.receivers
                               or not all(0 <= r < world_size for r in ranks)):
            return LivePlan(-1, "", "rank 0's plan names ranks outside the world")
        return self


@dataclass(frozen=True)
class Decision(Stored):
    """Rank 0's decision, which every rank follows: recover (``restart``) or end, and why; when it
    recovers, the agreed cause and where the next attempt's state comes from (``live``)."""

    restart: bool
    why: str
    cause: RecoveryCause | None = None
    live: LivePlan | None = None
    spares_left: int = -1  #: with spares, how many are left after this recovery (-1: no spares)

    BOUNDS: ClassVar[dict] = {"why": 500, "spares_left": (-1, 2**31 - 1)}


def needs_keeper(cause: RecoveryCause) -> bool:
    """A peer's process ended (its host lives): recovered in place only by its keeper's replacement."""
    return not cause.own and cause.kind is FailureKind.PEER_LOST and not cause.not_in_place


def keeper_replaces(store: Any, rank: int, end_seen: bool) -> bool:
    """A keeper replaces lost rank ``rank``: its end was seen (by a peer on its host, or its liveness
    helper, which saw its keeper live on) and its keeper announced itself (:func:`keeper_key`). A key
    alone is no evidence: a rank whose host is gone or cut off left its key behind, announced when it
    started, and so did a keeper killed with its rank."""
    return end_seen and bool(store.check([keeper_key(rank)]))
