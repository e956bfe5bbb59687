"""Sending live state from one rank to others (:func:`transfer`) and its digest (:func:`checksum`): the
state's structure travels as JSON, then its tensors' bytes in segments, each followed by the CRC-32 of
everything sent so far; receivers write into their own tensors of the same dtype and shape. Nothing is
pickled: a leaf that is neither a tensor, an array nor JSON is refused naming its path. A transfer that
fails on any rank fails on every rank together. Costs: ``bench/state_transfer.py``.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import itertools
import logging
import math
import time
import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..core import sharded, structure
from ..core.errors import StateTransferError
from ..core.hooks import log

#: Bytes per segment at most, and of each of the two staging buffers a rank may hold
#: (``bench/state_transfer.py``: no difference from 4 to 64 MB; 16 MB bounds the extra memory to 32 MB).
DEFAULT_CHUNK_BYTES = 16 * 2**20
#: Leaves of at least this many bytes travel straight from tensor to tensor; smaller ones are packed.
DIRECT_BYTES = 2**20
#: Bytes of the (truncated SHA-256) digest: :func:`checksum` is this many bytes in hex.
DIGEST_BYTES = 16
#: Bytes of the check after each segment of a transfer: the CRC-32 of everything sent so far.
TAIL_BYTES = 4
#: Hashed before the structure: a change of this format changes every checksum.
_FORMAT = b"fth-live-state-1\0"


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
