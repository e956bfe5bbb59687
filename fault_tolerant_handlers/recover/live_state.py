"""Live state: after a failure the ranks carry on from the in-memory state of the last step they
completed instead of a checkpoint (``docs/recovering.md``, "Live state"). A recovery takes these steps
with a :class:`Held`: **collect** (this rank's :class:`LiveReport`), **plan** (rank 0's :class:`LivePlan`,
:func:`plan_live`), **settle** (hold, wait to receive, or resume from the checkpoint) and, once the group
is re-formed, **send** (:func:`transfer`: the structure as JSON, then the tensors' bytes in segments
each followed by a CRC-32, never pickled; a transfer that fails, fails on every rank together).
Every operation is bounded by the group's timeout (gloo, CPU tensors). Costs: ``bench/state_transfer.py``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import hashlib
import itertools
import logging
import math
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.distributed as dist

from ..core import hooks, sharded, structure
from ..core.errors import StateTransferError
from ..core.failure import WORLD, Stored, cap_head
from ..core.hooks import log
from ..core.phases import Captured, RecoveryState
from ..core.schema import live_group_prefix

#: Bytes per segment at most, and of each of the two staging buffers a rank may hold
#: (``bench/state_transfer.py``: no difference from 4 to 64 MB; 16 MB bounds the extra memory to 32 MB).
DEFAULT_CHUNK_BYTES = 16 * 2**20
#: Leaves of at least this many bytes travel straight from tensor to tensor; smaller ones are packed.
DIRECT_BYTES = 2**20
#: Bytes of the (truncated SHA-256) digest: :func:`checksum` is this many bytes in hex.
DIGEST_BYTES = 16
#: Bytes of the check after each segment of a transfer: the CRC-32 of everything sent so far.
TAIL_BYTES = 4
#: Ranks holding state more steps apart than this are out of step (a step is an optimizer step).
MAX_STEPS_APART = 1
#: Hashed before the structure: a change of this format changes every checksum.
_FORMAT = b"fth-live-state-1\0"


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
    rng: str = ""  #: hex CRC-32 of the RNG states recorded for the next step ("": none)
    portable: str = ""  #: why this state cannot be sent to another rank ("" when it can)
    shard: bool = False  #: a sharded model's: this rank's own shard
    copies: tuple[int, ...] = ()  #: shard snapshots held here: (rank, step, CRC-32) triples

    BOUNDS: ClassVar[dict] = {"by": (0, WORLD), "step": (-1, 2**53 - 1), "unit": 40, "why": 300,
                              "checksum": ("hex", 2 * DIGEST_BYTES), "rng": ("hex", 8), "portable": 300,
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
    rng_shared: bool = False  #: the receivers take the source's RNG states too
    #: a sharded model's shards not resumed from their rank's own capture: (rank, holder, CRC-32)
    #: triples; the holder sends its copy (itself: its own older snapshot), the rank checks its CRC
    shards: tuple[int, ...] = ()

    BOUNDS: ClassVar[dict] = {"step": (-1, 2**53 - 1), "unit": 40, "why": 400, "source": (-1, WORLD),
                              "receivers": (0, WORLD, 4096), "whom": 400, "checksum": ("hex", 2 * DIGEST_BYTES),
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
        rng = "its RNG states too" if self.rng_shared else "not its RNG states (the ranks' differ or none were recorded)"
        return (f"live state, {self.unit} {self.step} (each rank's own; sent from rank {self.source} to "
                f"{self.whom}; {rng}), is held for the next call")

    def checked(self, world_size: int) -> LivePlan:
        """This plan, or a fallback when its ranks are not ranks of the world (read back from the store)."""
        ranks = self.receivers + ((self.source,) if self.receivers else ())
        if self.step >= 0 and (triples(self.shards, world_size, 2) is None or self.source in self.receivers
                               or not all(0 <= r < world_size for r in ranks)):
            return LivePlan(-1, "", "rank 0's plan names ranks outside the world")
        return self


class TransferFailure(str, enum.Enum):
    """What went wrong on one rank in :func:`transfer` (:attr:`StateTransferError.failures`)."""

    CHUNK = "a chunk arrived with another CRC than the source's"
    HEADER = "the header (structure of the state) could not be read"
    AGREED = "the state received does not have the agreed checksum"
    SOURCE = "the source could not send its state"


# --- the state's structure (JSON) and its tensors ------------------------------------------------

def _structure(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``(canonical JSON of the structure, [each tensor or array as a tensor, ...])``: a tensor as
    ``{"x": [dtype, shape]}``, a numpy array as ``{"a": [dtype, shape]}`` (:mod:`..core.structure`)."""
    leaves: list[torch.Tensor] = []

    def leaf(obj: Any, path: str) -> Any:
        tag, t = ("x", obj) if isinstance(obj, torch.Tensor) else ("a", structure.from_numpy(obj))
        if t is None:
            return None
        structure.dense(t, path, "live state")
        if why := sharded.unbacked(t):
            raise TypeError(f"{path} is {why}: live state carries tensors each process holds whole (its memory read "
                            "in place); a sharded model's is each rank's own snapshot, never sent")
        leaves.append(t)
        return {tag: [structure.dtype_name(t.dtype), list(t.shape)]}

    return structure.dumps(structure.encode(state, leaf, "live state")), leaves


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a leaf's bytes in row-major order, on its device (a copy only when the
    leaf is not contiguous, or a conjugate or negative view)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def checksum(state: Any) -> str:
    """A digest of ``state`` (32 hex characters, the same in every process for the same state): SHA-256
    over its structure and every tensor's bytes (not its device, not ``requires_grad``), read in place.

    Raises:
        TypeError: a leaf live state cannot carry, naming its path (``state['opt']['x']``).
    """
    text, leaves = _structure(state)
    digest = hashlib.sha256(_FORMAT)
    digest.update(text)
    buffer = None  # a leaf off the CPU goes through a staging buffer of at most a chunk, made once
    for leaf in leaves:
        flat = _flat_bytes(leaf)
        if flat.device.type == "cpu":
            digest.update(sharded.memory(flat))
            continue
        buffer = torch.empty(DEFAULT_CHUNK_BYTES, dtype=torch.uint8) if buffer is None else buffer
        for start in range(0, flat.numel(), DEFAULT_CHUNK_BYTES):
            n = min(DEFAULT_CHUNK_BYTES, flat.numel() - start)
            buffer[:n].copy_(flat[start:start + n])
            digest.update(sharded.memory(buffer[:n]))
    return digest.digest()[:DIGEST_BYTES].hex()


# --- transfer ------------------------------------------------------------------------------------

def _send(buffer: torch.Tensor, receivers: Sequence[int], group: Any) -> list:
    """Start sending ``buffer`` to every receiver; the works to wait for."""
    return [dist.isend(buffer, group=group, group_dst=r) for r in receivers]


def _recv(buffer: torch.Tensor, source: int, group: Any) -> Any:
    """Start receiving into ``buffer``; the work to wait for (tests wrap it to corrupt a chunk)."""
    return dist.irecv(buffer, group=group, group_src=source)


def _wait(works: Any) -> None:
    for work in works if isinstance(works, list) else [works]:
        work.wait()


def _rebuild(structure_bytes: bytes, local: Any, total: int) -> tuple[Any, list[torch.Tensor]]:
    """The state of ``structure_bytes``, reusing ``local``'s tensors of the same dtype and shape, and the
    tensors to write, in order, of at most ``total`` bytes (else ``ValueError``, as for a malformed one)."""
    dests: list[torch.Tensor] = []
    left = [total]

    def leaf(tag: str, value: Any, mine: Any, path: str) -> Any:
        if (tag not in ("x", "a") or type(value) is not list or len(value) != 2 or value[0] not in structure.DTYPES
                or type(value[1]) is not list or not all(type(n) is int and n >= 0 for n in value[1])):
            raise ValueError(f"{path} is a malformed leaf: {str({tag: value})[:200]}")
        dtype, shape = structure.DTYPES[value[0]], tuple(value[1])
        left[0] -= math.prod(shape) * dtype.itemsize
        if left[0] < 0:
            raise ValueError(f"{path}: the leaves hold more than the header's {total} bytes")
        if tag == "a":  # written into in place: the receiver's own array, contiguous and writeable
            t = structure.from_numpy(mine)
            fits = t is not None and mine.flags.c_contiguous and mine.flags.writeable
        else:
            t = mine.detach() if isinstance(mine, torch.Tensor) else None
            fits = (t is not None and t.layout is torch.strided and not t.is_meta and t.is_contiguous()
                    and not t.is_conj() and not t.is_neg())
        if fits and t.dtype == dtype and tuple(t.shape) == shape:
            dests.append(t)
            return mine
        out = torch.empty(shape, dtype=dtype)  # on the CPU
        dests.append(out)
        return out.numpy() if tag == "a" else out

    tree = structure.loads(structure_bytes)
    return structure.decode(tree, leaf, ValueError, local), dests


def _header(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _tail(crc: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(crc.to_bytes(TAIL_BYTES, "big")), dtype=torch.uint8)


def _plan(sizes: Sequence[int], chunk_bytes: int, direct_bytes: int) -> list[list[tuple[int, int, int]]]:
    """The segments the leaves' bytes travel in (each a list of ``(leaf, offset, length)``): a leaf of at
    least ``direct_bytes`` alone in slices of a chunk, smaller ones packed; at least one (its check travels)."""
    segments: list[list[tuple[int, int, int]]] = []
    pack: list[tuple[int, int, int]] = []
    packed = 0
    for leaf, size in enumerate(sizes):
        if size >= direct_bytes:
            if pack:
                segments.append(pack)
                pack, packed = [], 0
            segments.extend([(leaf, offset, min(chunk_bytes, size - offset))] for offset in range(0, size, chunk_bytes))
            continue
        if pack and packed + size > chunk_bytes:
            segments.append(pack)
            pack, packed = [], 0
        pack.append((leaf, 0, size))
        packed += size
    if pack or not segments:
        segments.append(pack)
    return segments


def _is_direct(segment: list[tuple[int, int, int]], sizes: Sequence[int], direct_bytes: int) -> bool:
    return len(segment) == 1 and sizes[segment[0][0]] >= direct_bytes


def _messages(plan: list, sizes: Sequence[int], direct_bytes: int) -> list[int]:
    """The length of every message after the header: a direct segment's bytes then its check, a packed one's both."""
    lengths = []
    for segment in plan:
        n = sum(piece[2] for piece in segment)
        lengths.extend([n, TAIL_BYTES] if _is_direct(segment, sizes, direct_bytes) else [n + TAIL_BYTES])
    return lengths


class _Staging:
    """Two buffers of one chunk, taken in turn: one is filled or checked while the other's is on its way."""

    def __init__(self, size: int) -> None:
        self.size, self.buffers, self.works, self.turn = size, [None, None], [[], []], 0

    def take(self) -> tuple[int, torch.Tensor]:
        slot, self.turn = self.turn, 1 - self.turn
        _wait(self.works[slot])  # what was sent from it is through
        self.works[slot] = []
        if self.buffers[slot] is None:
            self.buffers[slot] = torch.empty(self.size, dtype=torch.uint8)
        return slot, self.buffers[slot]


def _send_state(state: Any, receivers: Sequence[int], group: Any, chunk_bytes: int,
                ) -> tuple[int, tuple[TransferFailure, int] | None, BaseException | None]:
    """The source's part: ``(bytes sent, its failure, its own error)``."""
    try:
        text, leaves = _structure(state)
    except TypeError as exc:  # told to the receivers, raised here once the others know
        _wait(_send(_header([-1, 0, 0, 0, 0]), receivers, group))
        return 0, (TransferFailure.SOURCE, -1), exc
    sizes = [leaf.numel() * leaf.element_size() for leaf in leaves]
    total, direct = sum(sizes), min(DIRECT_BYTES, chunk_bytes)
    plan = _plan(sizes, chunk_bytes, direct)
    lengths = _messages(plan, sizes, direct)
    _wait(_send(_header([len(text), total, len(lengths), chunk_bytes, direct]), receivers, group))
    _wait(_send(_header(lengths), receivers, group))
    _wait(_send(torch.frombuffer(bytearray(text), dtype=torch.uint8), receivers, group))
    crc = zlib.crc32(text, zlib.crc32(_FORMAT))
    staging = _Staging(min(chunk_bytes, total) + TAIL_BYTES)
    flats: dict[int, torch.Tensor] = {}
    in_flight: collections.deque = collections.deque()

    def flat(leaf: int) -> torch.Tensor:
        if leaf not in flats:
            flats.clear()  # segments follow the leaves' order: only the current one is needed
            flats[leaf] = _flat_bytes(leaves[leaf])
        return flats[leaf]

    for segment in plan:
        if _is_direct(segment, sizes, direct):
            leaf, offset, n = segment[0]
            source = flat(leaf)[offset:offset + n]
            if source.device.type == "cpu":
                works = _send(source, receivers, group)
            else:
                slot, buffer = staging.take()
                buffer[:n].copy_(source)
                source, works = buffer[:n], _send(buffer[:n], receivers, group)
                staging.works[slot] = works
            crc = zlib.crc32(sharded.memory(source), crc)
            tail = _tail(crc)
            in_flight.append((works + _send(tail, receivers, group), source, tail))
        else:
            slot, buffer = staging.take()
            n = 0
            for leaf, offset, k in segment:
                if k:
                    buffer[n:n + k].copy_(flat(leaf)[offset:offset + k])
                n += k
            crc = zlib.crc32(sharded.memory(buffer[:n]), crc)
            buffer[n:n + TAIL_BYTES].copy_(_tail(crc))
            staging.works[slot] = _send(buffer[:n + TAIL_BYTES], receivers, group)
        while len(in_flight) > 2:
            _wait(in_flight.popleft()[0])
    for works, *_ in in_flight:
        _wait(works)
    for works in staging.works:
        _wait(works)
    return total, None, None


def _receive_state(state: Any, source: int, group: Any, expected: str | None,
                   chunk_bytes: int) -> tuple[Any, int, tuple[TransferFailure, int] | None]:
    """A receiver's part: ``(the state rebuilt, bytes received, its failure)``. Every message is received,
    also after a failure (the source is never left blocked), but a header out of bounds is refused before
    anything is allocated from it. With ``expected``, the bytes are hashed as they arrive (:func:`checksum`)."""
    header = _header([0, 0, 0, 0, 0])
    _wait(_recv(header, source, group))
    length, total, count, chunk, direct = (int(v) for v in header)
    if length == -1 and total == count == chunk == direct == 0:  # the source could not send: nothing follows
        return state, 0, None
    # every leaf takes at least one byte of the structure: at most 3 messages per leaf, 2 per chunk of bytes
    if not (0 <= length <= structure.MAX_BYTES and total >= 0 and chunk == chunk_bytes
            and direct == min(DIRECT_BYTES, chunk_bytes) and 0 < count <= 3 * length + 2 * (total // chunk) + 2):
        return state, 0, (TransferFailure.HEADER, -1)
    lengths_tensor = _header([0] * count)
    _wait(_recv(lengths_tensor, source, group))
    lengths = [int(v) for v in lengths_tensor]
    if not all(0 <= n <= chunk + TAIL_BYTES for n in lengths):
        return state, 0, (TransferFailure.HEADER, -1)
    raw = torch.empty(length, dtype=torch.uint8)
    _wait(_recv(raw, source, group))
    text = bytes(sharded.memory(raw))
    try:
        result, dests = _rebuild(text, state, total)
        sizes = [d.numel() * d.element_size() for d in dests]
        plan = _plan(sizes, chunk, direct)
        if sum(sizes) != total or _messages(plan, sizes, direct) != lengths:
            raise ValueError("the structure's sizes are not the header's")
    except (ValueError, TypeError):
        scratch = torch.empty(max(lengths, default=0), dtype=torch.uint8)
        for n in lengths:  # drained, so that the source finishes
            _wait(_recv(scratch[:n], source, group))
        return state, total, (TransferFailure.HEADER, -1)
    flats = [_flat_bytes(d) for d in dests]  # in place: each is contiguous
    crc = zlib.crc32(text, zlib.crc32(_FORMAT))
    digest = None
    if expected is not None:
        digest = hashlib.sha256(_FORMAT)
        digest.update(text)
    staging = _Staging(min(chunk, total) + TAIL_BYTES)

    def post(segment: list[tuple[int, int, int]]) -> tuple:
        """Start receiving a segment: ``(works, its bytes, its check, where they go or None)``."""
        if _is_direct(segment, sizes, direct):
            leaf, offset, n = segment[0]
            target = flats[leaf][offset:offset + n]
            data = target if target.device.type == "cpu" else staging.take()[1][:n]
            tail = torch.empty(TAIL_BYTES, dtype=torch.uint8)
            return [_recv(data, source, group), _recv(tail, source, group)], data, tail, (
                None if data is target else [(target, 0, n)])
        n = sum(piece[2] for piece in segment)
        buffer = staging.take()[1][:n + TAIL_BYTES]
        return ([_recv(buffer, source, group)], buffer[:n], buffer[n:],
                [(flats[leaf][offset:offset + k], pos, k) for (leaf, offset, k), pos in
                 zip(segment, itertools.accumulate([0] + [piece[2] for piece in segment]))])

    failure: tuple[TransferFailure, int] | None = None
    posted = collections.deque([post(plan[0])])
    with torch.no_grad():
        for index in range(len(plan)):
            if index + 1 < len(plan):
                posted.append(post(plan[index + 1]))  # arrives while this one is checked
            works, data, tail, copies = posted.popleft()
            _wait(works)
            if failure is not None:
                continue
            crc = zlib.crc32(sharded.memory(data), crc)
            if crc.to_bytes(TAIL_BYTES, "big") != bytes(sharded.memory(tail)):
                failure = (TransferFailure.CHUNK, index)
                continue
            if digest is not None:
                digest.update(sharded.memory(data))
            for target, pos, k in copies or ():
                if k:
                    target.copy_(data[pos:pos + k])
    if failure is None and digest is not None and digest.digest()[:DIGEST_BYTES].hex() != expected:
        failure = (TransferFailure.AGREED, -1)
    return result, total, failure


def transfer(state: Any, source: int, receivers: Sequence[int], group: Any = None, *,
             checksum: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Any:
    """Send the source's ``state`` to ``receivers``; collective over ``group`` (gloo). A receiver passes its
    own (stale) state to write into, or ``None``, and gets the state rebuilt (checked against ``checksum``
    when given); the others get ``state`` back. When any rank failed, every rank raises
    :class:`StateTransferError` naming each (the source its own ``TypeError`` for a leaf it cannot carry)."""
    receivers = sorted(set(int(r) for r in receivers))
    if not receivers:
        return state
    if source is None or source in receivers:
        raise ValueError(f"transfer(source={source!r}, receivers={receivers}): the source must be a rank "
                         "that does not receive (live state cannot serve when there is none)")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1024:
        raise ValueError(f"transfer(chunk_bytes={chunk_bytes!r}): an int >= 1024")
    me = dist.get_rank(group)
    failure: tuple[TransferFailure, int] | None = None
    own_error: BaseException | None = None
    result = state
    started = time.monotonic()
    total = 0
    if me == source:
        total, failure, own_error = _send_state(state, receivers, group, chunk_bytes)
    elif me in receivers:
        result, total, failure = _receive_state(state, source, group, checksum, chunk_bytes)
    # every rank learns every failure (one small all_gather), then all raise together
    kinds = list(TransferFailure)
    mine = _header([0, 0, 0] if failure is None else [1, kinds.index(failure[0]), failure[1]])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    failures = {rank: (kinds[int(v[1])].name, int(v[2])) for rank, v in enumerate(gathered) if int(v[0])}
    if failures:
        if own_error is not None:
            raise own_error  # the source's own error; the others raise the named one
        text = "; ".join(f"rank {rank}: {TransferFailure[kind].value}"
                         + (f" (chunk {chunk})" if chunk >= 0 else "")
                         for rank, (kind, chunk) in sorted(failures.items()))
        raise StateTransferError(f"live state from rank {source} to {receivers} failed: {text}", source, failures)
    if me in receivers:
        log(logging.INFO, "live state: received %.1f MB from rank %d in %.2f s", total / 2**20, source,
            time.monotonic() - started)
    return result


# --- the recovery's steps ------------------------------------------------------------------------

def plan_live(reports: list[LiveReport | None], world_size: int) -> LivePlan:
    """Rank 0's rule, given the reports read from the store: the newest step a rank holds (its gradients
    were reduced everywhere); ranks more than :data:`MAX_STEPS_APART` steps apart are out of step; at that
    step the checksum most hold wins (a tie: the lowest rank's) and every other rank receives it, with
    the source's RNG states when the ranks that hold it recorded the same. A sharded model: :func:`_plan_shards`.
    Where live state cannot serve, every rank resumes from its checkpoint (the plan says why)."""
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
    rngs = {r.rng for r in agreeing}
    return LivePlan(step, unit, "", portable[0].by, tuple(rank for rank, _ in whom), told, chosen,
                    rng_shared=len(rngs) == 1 and "" not in rngs)


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
        self.copies = _verified(captured.copies, getattr(captured.live, "unit", "") or "step")
        copies = tuple(n for (r, at), snap in sorted(self.copies.items(), key=lambda kv: -kv[0][1])[:MAX_COPIES]
                       for n in (r, at, snap.checksum))
        if self.captured is None:
            self.report = LiveReport(rank, -1, "", cap_head(captured.live_why or "no layer captures it", 300),
                                     copies=copies)
            return
        step, unit, rng = self.captured.step, self.captured.unit, self.captured.rng
        crc = 0  # of the RNG states (CPU and, if any, CUDA): equal on ranks whose RNG is the same
        for state in [] if rng is None else [rng[0], *(rng[1] or [])]:
            crc = zlib.crc32(sharded.memory(state), crc)
        rng_crc = "" if rng is None else f"{crc:08x}"
        snap = self.captured.state
        if isinstance(snap, sharded.Snapshot):  # this rank's shard, copied at the failure (data.live)
            if not snap.verify():
                why = (f"SnapshotChecksumError: its shard of {unit} {step} does not have its checksum (CRC-32 "
                       f"{snap.checksum or 0:08x} when copied, {snap.compute_checksum():08x} now): never loaded")
                log(logging.ERROR, "live state: %s", why)
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
                    extras = {"directory": own.directory,
                              "rng": list(own.rng) if plan.rng_shared and own.rng is not None else None}
                extras = transfer(extras, plan.source, plan.receivers)
        except (StateTransferError, TypeError, RuntimeError, ValueError) as err:
            self._fall_back(f"sending it from rank {plan.source} failed: {type(err).__name__}: {cap_head(str(err), 200)}")
            return
        if receives:
            extras = extras if isinstance(extras, dict) else {}
            directory, rng = extras.get("directory"), extras.get("rng")
            rng = tuple(rng) if isinstance(rng, list) and len(rng) == 2 else None
            if rng is None and own is not None and own.step == plan.step:
                rng = own.rng  # diverged at the same step: its own RNG states are those of that step
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


def _verified(snaps: Sequence[Any], unit: str) -> dict[tuple[int, int], sharded.Snapshot]:
    """The shard snapshots held here whose checksum still matches, by (rank, step); the others logged."""
    found: dict[tuple[int, int], sharded.Snapshot] = {}
    for snap in snaps:
        if snap.verify():
            found[snap.rank, snap.step] = snap
        else:
            log(logging.ERROR, "live state: SnapshotChecksumError: the copy of rank %d's shard of %s %d held here does "
                "not have its checksum (CRC-32 %08x when sealed, %08x now): never loaded", snap.rank, unit, snap.step,
                snap.checksum or 0, snap.compute_checksum())
    return found


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
