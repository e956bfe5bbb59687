"""The agreement of a recovery in place, on the first attempt's store (never the broken group): each
rank writes its view of the failure (:func:`cause_of`) and the live state it holds; rank 0 decides
(:func:`decide`); every rank follows the :class:`Decision`. Every store call is bounded (a store whose
host is gone would block for minutes); a rank that ends only tells why, within
:data:`~..core.config.RECOVER_TELL_SEC`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, ClassVar, Sequence

from ..core import attempts, config
from ..core.config import LOOK_FOR_LOST, RECOVER_POLL, RECOVER_TELL_SEC
from ..core.errors import RecoveryError, SectionMismatchError
from ..core.failure import MAX_RECORD_BYTES, FailureKind, FailureRecord, FailureState, PeerFailedError, Stored, tag_of
from ..core.hooks import first_line, log
from ..core.interrupts import store_ports
from ..core.schema import Bounded, Connection, StoreCallTimeout, agreement_key, unblock_stuck_calls
from . import spares
from .live_state import LivePlan, LiveReport, plan_live

#: Kinds that end the job as without recovery: a process or host gone, or signalled.
NOT_IN_PLACE = {
    FailureKind.PEER_LOST: "a rank was lost (its process or host is gone): a relaunch replaces it",
    FailureKind.PEER_SILENT: "a rank went silent (its host or network may be gone): a relaunch replaces it",
    FailureKind.RANK_SIGNALLED: "a rank was sent a signal that ends the job",
    FailureKind.STORE_LOST: "the c10d store was lost (every recovery is agreed on in it), on a host no rank runs on: a "
                            "relaunch with a store that answers resumes",
}


@dataclass(frozen=True)
class Decision(Stored):
    """Rank 0's decision, which every rank follows: recover (``restart``) or end, and why; when it
    recovers, the agreed cause and where the next attempt's state comes from (``live``)."""

    restart: bool
    why: str
    cause: FailureRecord | None = None
    live: LivePlan | None = None
    spares_left: int = -1  #: with spares, how many are left after this recovery (-1: no spares)

    MAX_BYTES: ClassVar[int] = 4 * MAX_RECORD_BYTES  # the cause, and a plan that names every rank
    BOUNDS: ClassVar[dict] = {"why": 500, "spares_left": (-1, 2**31 - 1)}


class AsIs(Decision):
    """End, raising the exception as it is (the job's own error, before any process group existed)."""


class Unsafe(Decision):
    """End: the function cannot be called again (raised as :class:`RecoveryError` after the first attempt)."""


class Misplaced(Unsafe):
    """End: the recovery wraps the launcher, not the ranks (always raised as :class:`RecoveryError`)."""


def cause_of(err: BaseException, rank: int, states: Sequence[FailureState] = ()) -> FailureRecord:
    """This rank's view of the failure that ended its call of the training function: a peer's record
    (its error carries it); else what this rank declared of itself (a hang, its signal: the attempt's
    failure ``states`` hold it); else the record it published of its exception (tagged on it)."""
    own = not isinstance(err, PeerFailedError)
    declared = [s.cause for s in states if s.cause is not None and s.cause.rank == s.cause.by == rank]
    record = (declared[0] if declared else tag_of(err).record) if own else err.record
    if record is None:
        record = FailureRecord.from_exception(err, rank=rank, section="")
    not_in_place = NOT_IN_PLACE.get(record.kind, "")
    if not own and record.kind is FailureKind.PEER_LOST and record.ended is not None and not record.ended.keeper_gone:
        not_in_place = ""  # a peer's process ended, its host lives: its keeper replaces it (checked in agree)
    elif isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        not_in_place = f"this rank's {type(err).__name__} ends the job"
    elif isinstance(err, SectionMismatchError):
        not_in_place = "the ranks were out of step (a bug in the job: it would repeat)"
    elif isinstance(err, RecoveryError):  # raised by the attempt: recovering in place cannot work in this job
        not_in_place = f"this rank found it cannot recover in place: {first_line(err, 300)}"
    # (a failure no rank could date, a broken collective's: dated now)
    return replace(record, own=own, not_in_place=not_in_place, time_ms=record.time_ms or int(time.time() * 1000))


def needs_keeper(cause: FailureRecord) -> bool:
    """A peer's process ended (its host lives): recovered in place only by its keeper's replacement."""
    return not cause.own and cause.kind is FailureKind.PEER_LOST and not cause.not_in_place


def lost_or_silent(cause: FailureRecord) -> bool:
    """A peer declared lost or silent with its end not seen (another host's rank, or its host or link
    gone): with spares, one takes its place unless its keeper replaces it."""
    return (not cause.own and cause.rank is not None and cause.kind in (FailureKind.PEER_LOST, FailureKind.PEER_SILENT)
            and cause.not_in_place == NOT_IN_PLACE[cause.kind])


def lost_records(sessions: Sequence[Any]) -> dict[int, Any]:
    """Rank -> the failed attempt's record declaring it lost or silent (:meth:`Session.lost_ranks`)."""
    lost: dict[int, Any] = {}
    for session in sessions:
        try:
            lost.update(session.lost_ranks())
        except Exception as err:  # noqa: BLE001 - the recovery's join timeout then names what is missing
            log(logging.DEBUG, "reading the lost ranks: %s", first_line(err))
    return lost


def agree(store: Any, rank: int, world_size: int, cause: FailureRecord, report: LiveReport, *, max_restarts: int,
          history: Sequence[FailureRecord], join_timeout: timedelta, layout: spares.Layout | None = None,
          since: float = 0.0, sessions: Sequence[Any] = ()) -> Decision:
    """This rank's part of the agreement of recovery :func:`attempts.in_place`: tell ``cause`` and
    ``report``, then decide (rank 0) or read rank 0's decision. ``history``: the causes recovered
    before; ``layout``: with spares, this process's place; ``since``: when the failure reached this
    rank (wall clock, told to a spare); ``sessions``: the failed attempt's (their records name the lost)."""
    gen = attempts.in_place()
    seconds = join_timeout.total_seconds()
    conn = Connection(lambda: store, timedelta(seconds=seconds + 5), "recover")
    bounded = Bounded(conn)
    started = time.monotonic()
    conn.deadline = started + RECOVER_TELL_SEC  # a rank that only tells why it ends; the others: below
    claims = None
    if layout is not None and layout.spares:
        claims = spares.Claims(bounded, layout, gen, since, seconds, lambda: lost_records(sessions))
    try:
        displaced = claims.displaced(rank) if claims is not None else ""
        if displaced:  # before it writes or counts anything: the rank is another process's now
            log(logging.ERROR, "%s", displaced)
            return Decision(False, displaced)
        if gen >= max_restarts and not cause.not_in_place:  # every rank knows: nobody waits for another
            cause = replace(cause, not_in_place=f"max_restarts={max_restarts} recoveries in place already spent")
        # a peer lost (with spares, silent too): only its keeper (its end seen, its keeper not gone) or a spare
        ended = getattr(lost_records(sessions).get(cause.rank), "ended", None) if needs_keeper(cause) else None
        end_seen = needs_keeper(cause) and not (ended is not None and ended.keeper_gone)
        lost = needs_keeper(cause) or (claims is not None and lost_or_silent(cause))
        claim = lost and not spares.keeper_replaces(bounded, cause.rank, end_seen)
        if claim or not cause.not_in_place:  # it takes part: it waits for the others (and claims a spare)
            conn.deadline = started + seconds + 10
        if claim and claims is None:  # a silent rank stays silent, a lost one lost
            cause = replace(cause, not_in_place=cause.not_in_place or NOT_IN_PLACE[FailureKind.PEER_LOST])
        elif claim:
            cause = replace(cause, not_in_place=claims.claim(cause.rank, cause.describe()))
        if not cause.not_in_place and claims is not None:  # other ranks lost at once: a spare each
            cause = replace(cause, not_in_place=claims.for_lost(gen))
        bounded.set(agreement_key(gen, "cause", rank), replace(cause, traceback="").to_json())
        if not cause.not_in_place:  # before it counts itself in: rank 0 reads it once every rank is
            bounded.set(agreement_key(gen, "live", rank), report.to_json())
        else:
            bounded.add(agreement_key(gen, "stop"), 1)
        bounded.add(agreement_key(gen, "arrived"), 1)
        if cause.not_in_place:
            return Decision(False, cause.not_in_place)
        if rank != 0:
            bounded.wait([agreement_key(gen, "decision")], timedelta(seconds=seconds + 5))
            decision = Decision.from_json(bounded.get(agreement_key(gen, "decision")), world_size)
            if decision is not None and decision.spares_left >= 0:
                spares.learned(decision.spares_left)  # every rank tells the same after several took
            return decision or Decision(False, "rank 0's decision could not be read")
        decision = decide(bounded, world_size, gen, seconds, max_restarts, history, claims)
        if decision.restart and claims is not None:
            decision = replace(decision, spares_left=spares.left_after(bounded, layout))
            spares.learned(decision.spares_left)
        bounded.set(agreement_key(gen, "decision"), decision.to_json())
        if decision.restart and gen:  # every rank passed the recovery before this one: its keys go
            old_keys = [agreement_key(gen - 1, kind, r) for kind in ("cause", "live") for r in range(world_size)]
            for key in old_keys + [agreement_key(gen - 1, k) for k in ("arrived", "stop", "decision")]:
                bounded.delete_key(key)
        return decision
    except Exception as err:  # noqa: BLE001 - the store may be what failed: end as without recovery
        why = first_line(err)
        if isinstance(err, StoreCallTimeout):  # the call blocked in c10d: its connection is cut, so it returns
            unblock_stuck_calls(store_ports(store), wait=0.5, busy_too=True)
            why = f"the store did not answer within {time.monotonic() - started:.1f} s"
        if cause.not_in_place:
            log(logging.WARNING, "could not tell the other ranks why this rank ends (%s)", why)
            return Decision(False, cause.not_in_place)
        return Decision(False, f"the recovery's store calls failed: {why}")
    finally:
        conn.close()


def decide(store: Any, world_size: int, gen: int, seconds: float, max_restarts: int,
           history: Sequence[FailureRecord] = (), claims: spares.Claims | None = None) -> Decision:
    """Rank 0's decision once every rank is in (or one ends, or ``seconds`` passed): the primary cause (the
    lowest rank that failed itself), unless it repeats the last one or ``max_restarts`` is spent, and the
    live-state plan. With spares (``claims``), a rank lost meanwhile gets a spare too."""
    deadline = time.monotonic() + seconds
    look_again = time.monotonic() + LOOK_FOR_LOST
    while True:
        arrived, stopped = store.add(agreement_key(gen, "arrived"), 0), store.add(agreement_key(gen, "stop"), 0)
        if stopped or arrived >= world_size:
            break
        if claims is not None and time.monotonic() >= look_again:
            # a rank lost after this one's failure (or at once, seen later): a spare for it too
            look_again = time.monotonic() + LOOK_FOR_LOST
            more = claims.for_lost(gen)
            if more:
                return Decision(False, more)
        if time.monotonic() > deadline:
            return Decision(False, f"only {arrived} of {world_size} ranks reached the recovery within "
                                   f"{seconds:g} s ({config.RECOVER_JOIN_ENV})")
        time.sleep(RECOVER_POLL)

    def read(kind: str) -> dict[int, Any]:
        keys = {r: agreement_key(gen, kind, r) for r in range(world_size)}
        present = {r: k for r, k in keys.items() if store.check([k])}
        return dict(zip(present, store.multi_get(list(present.values())))) if present else {}

    causes = {r: c for r, raw in read("cause").items() if (c := FailureRecord.from_json(raw, world_size)) is not None}
    for by, cause in causes.items():  # by rank, lowest first
        if cause.not_in_place:
            return Decision(False, f"{cause.not_in_place} (rank {by}: {cause.describe()})")
    primary = next((c for c in causes.values() if c.own), next(iter(causes.values()), None))
    if primary is None:
        return Decision(False, "no rank could say what failed")
    if gen >= max_restarts:
        return Decision(False, f"max_restarts={max_restarts} recoveries in place already spent", primary)
    signature = lambda c: (c.rank, c.exc_type, c.step)  # noqa: E731 - same rank, type and iteration: it repeats
    if history and primary.step is not None and signature(primary) == signature(history[-1]):
        return Decision(False, f"the failure repeats at the same iteration ({primary.describe()}): recovering "
                               "again would fail again", primary)
    reports = [LiveReport.from_json(raw, world_size) for raw in read("live").values()]
    return Decision(True, primary.describe(), primary, plan_live(reports, world_size))
