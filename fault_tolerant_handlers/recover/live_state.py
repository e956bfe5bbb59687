"""Live state: after a failure the ranks carry on from the in-memory state of the last step they
completed instead of a checkpoint (``docs/recovering.md``, "Live state"). A recovery takes these steps
with a :class:`Held`: **collect** (this rank's :class:`LiveReport`), **plan** (rank 0's :class:`LivePlan`,
:func:`plan_live`), **settle** (hold, wait to receive, or resume from the checkpoint) and, once the group
is re-formed, **send** (:func:`.transfer.transfer`, over a gloo group of its own).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from ..core import hooks, rng_state, sharded
from ..core.errors import StateTransferError
from ..core.failure import WORLD, Stored, cap_head
from ..core.hooks import log
from ..core.phases import Captured, RecoveryState
from ..core.schema import live_group_prefix
from .transfer import DIGEST_BYTES, checksum, transfer

#: Ranks holding state more steps apart than this are out of step (a step is an optimizer step).
MAX_STEPS_APART = 1
#: Shard copies a report lists at most (the newest first).
MAX_COPIES = 64


def triples(flat: tuple[int, ...], world: int = 2**31, ranks: int = 1) -> list[tuple[int, int, int]] | None:
    """``flat`` as (rank, step or holder, CRC-32) triples; ``None`` unless the first ``ranks`` of each
    are ranks of ``world`` and the last is a CRC-32 (a report or a plan read back from the store)."""
    out = list(zip(flat[::3], flat[1::3], flat[2::3]))
    fits = all(0 <= t[i] < world for t in out for i in range(ranks)) and all(0 <= t[2] < 2**32 for t in out)
    return out if fits and len(flat) % 3 == 0 else None


@dataclass(frozen=True)
class LiveReport(Stored):
    """What one rank holds for the next attempt. With ``shard``, ``checksum`` is its snapshot's CRC-32
    (verified where it is held); ``copies`` are checksum verified (:class:`~..data.replicas.ShardReplicas`)."""

    by: int  #: the rank that says it
    step: int  #: the last step it completed, whose state it holds (-1: none)
    unit: str  #: "iteration" (Ignite), "global step" (Lightning), "" (none)
    why: str  #: why it holds none ("" when it does)
    checksum: str = ""  #: hex SHA-256 of the state ("": not taken)
    rng: str = ""  #: hex CRC-32s of the RNG states recorded for the next step, one per ``rng_state.PARTS`` ("": none)
    portable: str = ""  #: why this state cannot be sent to another rank ("" when it can)
    shard: bool = False  #: a sharded model's: this rank's own shard
    copies: tuple[int, ...] = ()  #: shard snapshots held here: (rank, step, CRC-32) triples

    BOUNDS: ClassVar[dict] = {"by": (0, WORLD), "step": (-1, 2**53 - 1), "unit": 40, "why": 300,
                              "checksum": ("hex", 2 * DIGEST_BYTES), "rng": ("hex", 24), "portable": 300,
                              "copies": (0, 2**53 - 1, 3 * MAX_COPIES)}

    def problem(self, world: int) -> str | None:
        return None if triples(self.copies, world) is not None else "field 'copies' is not (rank, step, CRC-32) triples"


@dataclass(frozen=True)
class LivePlan:
    """Where the next attempt's state comes from, the same for every rank: live state at ``step``, each
    rank its own but the ``receivers``'; or (``step`` -1) the newest checkpoint, because of ``why``."""

    step: int
    unit: str = ""
    why: str = ""
    source: int = -1  #: the rank whose state the receivers get (-1: nobody receives)
    receivers: tuple[int, ...] = ()  #: ranks that get the source's state
    whom: str = ""  #: why each receiver receives, for the log ("rank 1: its process was replaced")
    checksum: str = ""  #: the source's state's checksum ("": not taken), checked by the receivers
    rng_shared: tuple[int, ...] = ()  #: the receivers take these of the source's RNG states too (``rng_state.PARTS``)
    #: a sharded model's shards not resumed from their rank's own capture: (rank, holder, CRC-32)
    #: triples; the holder sends its copy (itself: its own older snapshot), the rank checks its CRC
    shards: tuple[int, ...] = ()

    BOUNDS: ClassVar[dict] = {"step": (-1, 2**53 - 1), "unit": 40, "why": 400, "source": (-1, WORLD),
                              "receivers": (0, WORLD, 4096), "whom": 400, "checksum": ("hex", 2 * DIGEST_BYTES),
                              "rng_shared": (0, len(rng_state.PARTS) - 1, len(rng_state.PARTS)),
                              "shards": (0, 2**32 - 1, 3 * 4096)}

    def describe(self) -> str:
        """The plan, as the recovery's line tells it (what the next attempt really carried on from is
        told when its loop starts)."""
        if self.step < 0:
            return ("the next call starts from what it loads itself: the newest checkpoint, or the start if it loads "
                    f"none (live state cannot serve: {self.why})")
        if self.shards:
            return f"live state, {self.unit} {self.step} ({self.whom}), is held for the next call"
        if not self.receivers:
            return f"live state, {self.unit} {self.step} (each rank's own), is held for the next call"
        differ = " or ".join(name for i, name in enumerate(rng_state.PARTS) if i not in self.rng_shared)
        rng = ("not its RNG states (the ranks' differ or none were recorded)" if not self.rng_shared else
               f"its RNG states too, but not {differ} (the ranks' differ)" if differ else "its RNG states too")
        return (f"live state, {self.unit} {self.step} (each rank's own; sent from rank {self.source} to "
                f"{self.whom}; {rng}), is held for the next call")

    def checked(self, world_size: int) -> LivePlan:
        """This plan, or a fallback when its ranks are not ranks of the world (read back from the store)."""
        ranks = self.receivers + ((self.source,) if self.receivers else ())
        if self.step >= 0 and (triples(self.shards, world_size, 2) is None or self.source in self.receivers
                               or not all(0 <= r < world_size for r in ranks)):
            return LivePlan(-1, "", "rank 0's plan names ranks outside the world")
        return self


def plan_live(reports: list[LiveReport | None], world_size: int) -> LivePlan:
    """Rank 0's rule, given the reports read from the store: the newest step a rank holds (its gradients
    were reduced everywhere); ranks more than :data:`MAX_STEPS_APART` steps apart are out of step; at that
    step the checksum most hold wins (a tie: the lowest rank's) and every other rank receives it, with
    each part of the source's RNG states that the ranks holding it recorded the same. A sharded model:
    :func:`_plan_shards`. Where live state cannot serve, every rank resumes from its checkpoint (the plan says why)."""
    by_rank = {r.by: r for r in reports if r is not None}
    for rank in range(world_size):
        if rank not in by_rank:
            return LivePlan(-1, "", f"rank {rank}'s report could not be read")
    ranks = [by_rank[r] for r in range(world_size)]
    holders = [r for r in ranks if r.step >= 0]
    if not holders:
        return LivePlan(-1, "", f"no rank holds live state (rank 0: {ranks[0].why or 'no live state'})")
    step, units = max(r.step for r in holders), {r.unit for r in holders}
    if len(units) > 1 or step - min(r.step for r in holders) > MAX_STEPS_APART:
        held = ", ".join(f"rank {r.by} at {r.unit} {r.step}" for r in holders)
        return LivePlan(-1, "", f"the ranks completed steps too far apart ({held})")
    unit = units.pop()
    if any(r.shard for r in holders):
        return _plan_shards(ranks, step, unit)
    at_step = [r for r in holders if r.step == step]
    counts = collections.Counter(r.checksum for r in at_step)
    # the most held checksum; among equals, the one the lowest rank holds (at_step is in rank order)
    chosen = max(counts, key=lambda c: (counts[c], -min(r.by for r in at_step if r.checksum == c)))
    agreeing = [r for r in at_step if r.checksum == chosen]
    whom = [(r.by, r.why or "no live state" if r.step < 0 else
             f"a step behind ({unit} {r.step})" if r.step < step else "its state's checksum differs (diverged)")
            for r in ranks if r.step < step or r.checksum != chosen]
    if not whom:
        return LivePlan(step, unit, "")
    told = "; ".join(f"rank {rank}: {why}" for rank, why in whom)
    portable = [r for r in agreeing if not r.portable]
    if not portable:
        return LivePlan(-1, "", f"{told}, and rank {agreeing[0].by}'s state cannot be sent: {agreeing[0].portable}")
    crcs = [[r.rng[i:i + 8] for i in range(0, 8 * len(rng_state.PARTS), 8)] for r in agreeing]
    shared = tuple(i for i in range(len(rng_state.PARTS)) if all(c[i] for c in crcs) and len({c[i] for c in crcs}) == 1)
    return LivePlan(step, unit, "", portable[0].by, tuple(rank for rank, _ in whom), told, chosen, rng_shared=shared)


def _plan_shards(ranks: list[LiveReport], step: int, unit: str) -> LivePlan:
    """A sharded model's rule: the newest step at or below ``step`` every rank's shard is held at (by the
    rank itself, preferred, or as a partner's copy); ``shards`` names each not resumed from its own capture."""
    held: dict[int, dict[int, list[tuple[int, int]]]] = {r.by: {} for r in ranks}  # rank -> step -> [(holder, crc)]
    for r in ranks:
        if r.step >= 0 and r.shard:
            held[r.by].setdefault(r.step, []).append((-1, int(r.checksum or "0", 16)))  # -1: its capture
        for rank, at, crc in triples(r.copies):
            if rank in held:
                held[rank].setdefault(at, []).append((r.by, crc))
    for r in ranks:
        if not held[r.by]:
            why = r.why or "its state is not a shard"
            return LivePlan(-1, "", cap_head(f"rank {r.by} holds no shard of its own ({why}), and no other rank "
                                             "holds a copy of it", 400))
    common = set.intersection(*(set(steps) for steps in held.values()))
    if not common:
        if all(r.step >= 0 and r.shard and not r.copies for r in ranks):  # no copies anywhere: own shards only
            other = next(r for r in ranks if r.step != step)
            return LivePlan(-1, "", f"the ranks' shards are of different steps (rank {other.by} at {unit} "
                                    f"{other.step}, another at {unit} {step})")
        told = "; ".join(f"rank {rank}: " + ", ".join(
            f"{at} ({'its own' if h in (-1, rank) else f'rank {h}'+chr(39)+'s copy'})" for at in sorted(steps, reverse=True)
            for h, _ in steps[at][:1]) for rank, steps in held.items())
        return LivePlan(-1, "", cap_head(f"no step every rank's shard is held at ({told})", 400))
    at = max(common)
    shards, whom = [], []
    for rank, steps in held.items():
        holders = sorted(steps[at], key=lambda h: (h[0] != -1, h[0] != rank, h[0]))
        holder, crc = holders[0]
        if holder == -1:
            continue
        shards += [rank, holder, crc]
        whom.append(f"rank {rank}: its shard of {unit} {at} from "
                    + ("its own replica" if holder == rank else f"rank {holder}'s copy") + f" (CRC-32 {crc:08x})")
    if at < step:  # a rank lost after its step's update, before its copy of it was held
        whom.append(f"{unit} {step} computed again: " + ", ".join(
            f"rank {rank}'s shard" for rank, steps in held.items() if step not in steps) + " of it is held nowhere")
    return LivePlan(at, unit, "", shards=tuple(shards), whom=cap_head("; ".join(whom), 400))


class Held:
    """This rank's live state through one recovery (``state_of(**changes)``: the recovery's state)."""

    def __init__(self, state_of: Callable[..., RecoveryState]) -> None:
        self.state_of = state_of
        self.captured: Captured | None = None  # this rank's live state of the failed attempt
        self.report: LiveReport | None = None  # what this rank tells the others it holds
        self.plan: LivePlan | None = None  # where the next attempt's state comes from (rank 0's plan)
        self.sending: Captured | None = None  # this rank's live state, kept for the transfer
        self.copies: dict[tuple[int, int], sharded.Snapshot] = {}  # (rank, step): shard snapshots held here
        self.directory: str | None = None  # where the loop's checkpoints are written, for a shard sent

    def collect(self, rank: int) -> None:
        """This rank's live state of the failed attempt, and the report it tells the others."""
        captured = hooks.run(hooks.CAPTURE_LIVE, self.state_of())
        self.captured = captured.live
        unit = getattr(captured.live, "unit", "") or "step"  # the copies whose checksum still matches
        self.copies = {(s.rank, s.step): s for s in captured.copies
                       if not _damaged(s, f"the copy of rank {s.rank}'s shard of {unit} {s.step} held here")}
        copies = tuple(n for (r, at), snap in sorted(self.copies.items(), key=lambda kv: -kv[0][1])[:MAX_COPIES]
                       for n in (r, at, snap.checksum))
        if self.captured is None:
            self.report = LiveReport(rank, -1, "", cap_head(captured.live_why or "no layer captures it", 300),
                                     copies=copies)
            return
        step, unit, rng = self.captured.step, self.captured.unit, self.captured.rng
        crcs = []  # of each part of the RNG states: equal on ranks whose generators are the same
        for group in [] if rng is None else rng_state.groups(rng):
            crcs.append(0)
            for state in group:
                crcs[-1] = zlib.crc32(sharded.memory(state), crcs[-1])
        rng_crc = "".join(f"{crc:08x}" for crc in crcs)
        snap = self.captured.state
        if isinstance(snap, sharded.Snapshot):  # this rank's shard, copied at the failure (data.live)
            why = _damaged(snap, f"its shard of {unit} {step}", "copied")
            if why:
                self.captured, self.report = None, LiveReport(rank, -1, "", why, copies=copies)
                return
            self.report = LiveReport(rank, step, unit, "", f"{snap.checksum:08x}", rng_crc, shard=True, copies=copies)
            return
        digest, portable = "", ""
        try:
            digest = checksum(snap)
        except TypeError as err:  # a leaf that cannot be sent (named by its path): kept for this rank only
            portable = cap_head(str(err), 300)
        self.report = LiveReport(rank, step, unit, "", digest, rng_crc, portable)

    def hold(self, captured: Captured | None) -> None:
        """What the next attempt resumes from: ``captured`` (``None``: its newest checkpoint)."""
        hooks.run(hooks.SETTLE_LIVE, self.state_of(live=captured))

    def _fall_back(self, why: str) -> None:
        """Every rank resumes from its checkpoint, because of ``why``."""
        self.plan = LivePlan(-1, "", cap_head(why, 400))
        self.hold(None)

    def settle(self, restart: bool, plan: LivePlan | None, rank: int, world_size: int) -> None:
        """Follow rank 0's ``plan`` when the job recovers (``restart``): hold this rank's live state for the next
        attempt (a receiver gets the source's once the group is re-formed: :meth:`send`), or nothing."""
        captured, self.captured = self.captured, None
        self.directory = getattr(captured, "directory", None)
        if not restart:
            self.hold(None)
            return
        plan = (plan or LivePlan(-1, "", "rank 0 made no plan (or it could not be read)")).checked(world_size)
        # (holder, CRC-32) of this rank's shard, or None (its own capture)
        mine = next(((h, c) for r, h, c in triples(plan.shards) if r == rank), None)
        if plan.step >= 0 and mine is not None:  # this rank's shard from a copy: its own replica, or a partner's
            own = self.copies.get((rank, plan.step)) if mine[0] == rank else None
            if mine[0] == rank and (own is None or own.checksum != mine[1]):
                plan = LivePlan(-1, "", "this rank does not hold its replica of the agreed step (a bug: the plan "
                                        "says it does)")
            self.plan = plan  # a holder's copies stay in self.copies for send(); a receiver gets its shard there
            self.hold(Captured(plan.step, plan.unit, own, self.directory, sharded.rng_of(own))
                      if own is not None and plan.step >= 0 else None)
            return
        receives = plan.step >= 0 and rank in plan.receivers
        if plan.step >= 0 and not receives and (captured is None or captured.step != plan.step
                                                or captured.unit != plan.unit):
            plan = LivePlan(-1, "", "this rank does not hold the agreed step (a bug: the plan says it does)")
        self.plan = plan
        # a receiver keeps its stale state until the transfer, which writes into its tensors
        self.sending = captured if plan.step >= 0 and plan.receivers else None
        self.hold(captured if plan.step >= 0 and not receives else None)

    def send(self, store: Any, rank: int, world_size: int, timeout: timedelta, timings: dict) -> None:
        """The plan names receivers: the source sends them its live state over a gloo group formed for
        it on the first attempt's ``store``, before the training function is called again."""
        plan, own, self.sending = self.plan, self.sending, None
        copies, self.copies = self.copies, {}
        if plan is not None and plan.step >= 0 and any(r != h for r, h, _ in triples(plan.shards)):
            self._send_shards(plan, copies, store, rank, world_size, timeout, timings)
            return
        if plan is None or plan.step < 0 or not plan.receivers:
            return
        t0 = time.monotonic()
        receives = rank in plan.receivers
        try:
            with _group(store, "live-state", rank, world_size, timeout):
                mine = own.state if own is not None and (rank == plan.source or receives) else None
                state = transfer(mine, plan.source, plan.receivers, checksum=plan.checksum or None)
                extras = None
                if rank == plan.source:
                    extras = {"directory": own.directory, "rng": rng_state.only(own.rng, plan.rng_shared)
                              if plan.rng_shared and own.rng is not None else None}
                extras = transfer(extras, plan.source, plan.receivers)
        except (StateTransferError, TypeError, RuntimeError, ValueError) as err:
            self._fall_back(f"sending it from rank {plan.source} failed: {type(err).__name__}: {cap_head(str(err), 200)}")
            return
        if receives:
            extras = extras if isinstance(extras, dict) else {}
            directory, rng = extras.get("directory"), extras.get("rng")
            # a part not sent (or none, or malformed): diverged at the same step, its own is that step's
            own_rng = own.rng if own is not None and own.step == plan.step else None
            rng = rng_state.merged(rng_state.checked(rng), own_rng)
            self.hold(Captured(plan.step, plan.unit, state, directory if isinstance(directory, str) else None, rng))
        timings.setdefault("parts", {})["live state sent"] = time.monotonic() - t0

    def _send_shards(self, plan: LivePlan, copies: dict, store: Any, rank: int, world_size: int,
                     timeout: timedelta, timings: dict) -> None:
        """Every shard a partner's copy serves (:attr:`LivePlan.shards`): its holder sends it to its rank,
        which loads it only with the agreed CRC-32. One failure anywhere: every rank resumes from its checkpoint."""
        t0 = time.monotonic()
        received, why = None, ""
        try:
            with _group(store, "live-shards", rank, world_size, timeout):
                for r, holder, crc in triples(plan.shards):
                    if r == holder:
                        continue
                    snap = copies.get((r, plan.step)) if rank == holder else None
                    got = transfer(None if snap is None else _wire(snap, self.directory), holder, [r])
                    if rank == r:
                        received, why = _unwire(got, r, plan, crc, holder)
                bad = torch.tensor([1 if why else 0])
                dist.all_reduce(bad)
            if int(bad):
                why = why or "another rank's shard from a copy did not have the agreed checksum"
        except (StateTransferError, TypeError, RuntimeError, ValueError) as err:
            why = f"sending it failed: {type(err).__name__}: {cap_head(str(err), 200)}"
        if why:
            log(logging.ERROR, "live state: %s: never loaded; every rank resumes from its checkpoint", why)
            self._fall_back(why)
            return
        if received is not None:
            self.hold(received)
        timings.setdefault("parts", {})["live shards sent"] = time.monotonic() - t0


@contextlib.contextmanager
def _group(store: Any, name: str, rank: int, world_size: int, timeout: timedelta):
    """A gloo group of the re-formed world to send live state over, destroyed after."""
    dist.init_process_group("gloo", store=dist.PrefixStore(live_group_prefix(name), store), rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _damaged(snap: sharded.Snapshot, what: str, when: str = "sealed") -> str:
    """Why ``snap`` (``what``) is never loaded, logged; ``""`` when its checksum still matches."""
    if snap.verify():
        return ""
    why = (f"SnapshotChecksumError: {what} does not have its checksum (CRC-32 {snap.checksum or 0:08x} when {when}, "
           f"{snap.compute_checksum():08x} now): never loaded")
    log(logging.ERROR, "live state: %s", why)
    return why


def _wire(snap: sharded.Snapshot, directory: str | None) -> dict:
    """A shard snapshot as :func:`transfer` carries it (tensors and JSON leaves)."""
    return {"rank": snap.rank, "step": snap.step, "checksum": snap.checksum,
            "manifest": torch.frombuffer(bytearray(snap.manifest), dtype=torch.uint8), "payload": snap.payload,
            "directory": directory}


def _unwire(got: Any, rank: int, plan: LivePlan, crc: int, holder: int) -> tuple[Captured | None, str]:
    """The shard received from ``holder``, if it is ``rank``'s of the plan's step with the agreed ``crc``."""
    step = plan.step
    try:
        snap = sharded.Snapshot(got["rank"], got["step"], bytes(sharded.memory(got["manifest"])), got["payload"],
                                got["checksum"])
        sharded.read_manifest(snap.manifest, snap.payload.numel())
        if (snap.rank, snap.step, snap.checksum) != (rank, step, crc) or not snap.verify():
            return None, (f"SnapshotChecksumError: the copy of rank {rank}'s shard of step {step} from rank {holder} "
                          f"does not have the agreed checksum (CRC-32 {crc:08x} agreed, {snap.compute_checksum():08x} "
                          "received)")
        rng = sharded.rng_of(snap)  # the rank's RNG states of that step, under the same checksum
    except (KeyError, TypeError, AttributeError, sharded.ManifestError, sharded.SnapshotChecksumError) as err:
        return None, f"the copy of rank {rank}'s shard from rank {holder} is malformed ({type(err).__name__}: {err})"
    directory = got.get("directory")
    log(logging.WARNING, "live state: received its shard of %s %d from rank %d's copy (CRC-32 %08x, checked)",
        plan.unit, step, holder, crc)
    return Captured(step, plan.unit, snap, directory if isinstance(directory, str) else None, rng), ""
