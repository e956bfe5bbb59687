"""Each rank's shard of a sharded model kept in a partner's CPU memory, checksummed (issue 42, first piece).

With FSDP2 (``fully_shard``, ``DTensor``) each rank holds the only copy of its shard. Here:

* :func:`choose_partners`: which ranks hold a copy of each rank's shard: the rank at the same place
  on the next host(s) of a ring over hosts (NVIDIA's resiliency extension's clique rule, ranks
  ``replication_jump`` = ranks-per-host apart), another rank of the same host only when there is no
  other host (logged).
* :func:`take_snapshot` / :func:`restore`: one rank's state dict (model and optimizer
  ``state_dict()`` with ``DTensor`` values, plain tensors, numbers, RNG states) as one contiguous CPU
  byte buffer, copied once, a CRC-32 over its manifest and bytes, and the step; the manifest (per
  leaf: path, dtype, shape, offset, ``DTensor`` placements and mesh) is bounded JSON, never pickle:
  the bytes may come from a peer. :func:`restore` refuses a snapshot whose checksum does not match
  (:class:`SnapshotChecksumError`) or whose manifest is malformed or too large (:class:`ManifestError`).
* :class:`ShardReplicas`: after each ``replicate_every``-th optimizer step, the snapshot is copied
  on the caller's thread and sent to the partners from a background thread on a gloo group of its
  own, while another thread receives the copies this rank holds. Nothing on the training thread
  waits for a send: a snapshot taken while the previous one is still pending replaces it (counted).

The recovery does not use this yet (see docs/sharded.md).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import sys
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..core.hooks import log

#: Names the manifest's layout: a change of it changes every checksum.
FORMAT = "fth-shard-1"
#: The largest manifest accepted (bytes of JSON), from a peer or not.
MAX_MANIFEST_BYTES = 16 * 2**20
#: The deepest nesting of containers a manifest may describe.
MAX_DEPTH = 64
#: Each leaf's bytes start at a multiple of this (any dtype's view of the buffer is aligned).
_ALIGN = 64
#: The dtypes a manifest may name (``str(torch.float32)`` minus the ``torch.`` prefix).
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8,
    torch.bool)}
#: The header sent before each snapshot: format tag, rank, step, manifest bytes, payload bytes, CRC-32.
_HEADER = 6
_TAG = 0x46544853  # "FTHS"
_STOP = -1


class ManifestError(ValueError):
    """A snapshot's manifest is malformed, too large or does not fit its bytes: nothing is rebuilt."""


class SnapshotChecksumError(ValueError):
    """A snapshot's bytes do not have the checksum it was sent with: it is never loaded."""


# -- partner choice -------------------------------------------------------------------------------

def choose_partners(hosts: Sequence[str], partners: int = 1) -> list[tuple[int, ...]]:
    """For each rank (``hosts[r]`` is rank ``r``'s host), the ranks that hold a copy of its shard.

    Copy ``k`` (1-based) of a rank at place ``i`` on its host goes to the rank at place ``i`` (modulo
    that host's ranks) of the ``k``-th next host in a ring over the hosts, in order of first
    appearance: one host's ranks' copies are on other hosts. Copies beyond the other hosts go to other
    ranks of the same host, then to any rank left. Pure (the log line is the only side effect).

    Raises:
        ValueError: ``partners`` not in ``1 .. len(hosts) - 1``.
    """
    world = len(hosts)
    if not 1 <= partners < max(world, 2) or world < 2:
        raise ValueError(f"choose_partners(partners={partners!r}): valid 1 .. world size - 1 "
                         f"({world - 1}) with at least 2 ranks")
    order: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        order.setdefault(host, []).append(rank)
    names = list(order)
    chosen = []
    same_host = 0
    for rank, host in enumerate(hosts):
        h, local = names.index(host), order[host].index(rank)
        ring = [order[names[(h + k) % len(names)]] for k in range(1, len(names))]
        own = order[host]
        candidates = ([ranks[local % len(ranks)] for ranks in ring]
                      + [own[(local + j) % len(own)] for j in range(1, len(own))]
                      + list(range(world)))
        picked: list[int] = []
        for c in candidates:
            if c != rank and c not in picked:
                picked.append(c)
            if len(picked) == partners:
                break
        same_host += sum(hosts[p] == host for p in picked)
        chosen.append(tuple(picked))
    if same_host:
        log(logging.WARNING, "shard replicas: %d of %d copies are held on their own rank's host (%d host(s) "
            "for %d ranks, %d copy/copies each): a lost host loses those", same_host, world * partners,
            len(names), world, partners)
    return chosen


def held_by(chosen: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The ranks whose copies ``rank`` holds under ``chosen`` (:func:`choose_partners`)."""
    return [r for r, ps in enumerate(chosen) if rank in ps]


# -- snapshot -------------------------------------------------------------------------------------

@dataclass
class Snapshot:
    """One rank's state at one step: ``payload`` (a 1-D uint8 CPU tensor) holds every tensor's bytes,
    ``manifest`` (JSON bytes) how to rebuild them; ``checksum`` is a CRC-32 over both (``None`` until
    :meth:`seal`)."""

    rank: int
    step: int
    manifest: bytes
    payload: torch.Tensor
    checksum: int | None = None

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + self.payload.numel()

    def compute_checksum(self) -> int:
        crc = zlib.crc32(self.manifest)
        return zlib.crc32(memoryview(self.payload.numpy()), crc)  # releases the GIL over large buffers

    def seal(self) -> Snapshot:
        self.checksum = self.compute_checksum()
        return self

    def verify(self) -> bool:
        return self.checksum is not None and self.compute_checksum() == self.checksum


def _placement(p: Any, path: str) -> list:
    if type(p) is Shard:
        return ["S", p.dim]
    if type(p) is Replicate:
        return ["R"]
    if type(p) is Partial:
        return ["P", p.reduce_op]
    raise TypeError(f"{path} has placement {p!r} ({type(p).__qualname__}), which a shard snapshot cannot "
                    "rebuild: Shard, Replicate or Partial")


def _describe(obj: Any, path: str, leaves: list, tensors: list, depth: int) -> Any:
    """The JSON tree of ``obj``: containers as ``{"d"|"l"|"t": ...}``, values as ``{"v": x}``,
    tensors as ``{"T": index}`` into ``leaves`` (their local shards appended to ``tensors``)."""
    if depth > MAX_DEPTH:
        raise TypeError(f"{path} is nested deeper than {MAX_DEPTH}")
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"{path} has a key {k!r} of type {type(k).__qualname__}: str or int keys only")
            items.append([k, _describe(v, f"{path}[{k!r}]", leaves, tensors, depth + 1)])
        return {"d": items}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "t":
                [_describe(v, f"{path}[{i}]", leaves, tensors, depth + 1) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, str)) or (isinstance(obj, float) and math.isfinite(obj)):
        return {"v": obj}
    if isinstance(obj, float):
        return {"f": repr(obj)}  # inf, nan: JSON has no literal for them
    leaf: dict[str, Any] = {"path": path}
    if isinstance(obj, DTensor):
        mesh = obj.device_mesh
        leaf.update(placements=[_placement(p, path) for p in obj.placements], global_shape=list(obj.shape),
                    global_stride=list(obj.stride()), mesh={"shape": list(mesh.shape),
                                                            "dim_names": list(mesh.mesh_dim_names or []),
                                                            "ranks": mesh.mesh.flatten().tolist()})
        obj = obj.to_local()
    elif type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":  # RNG states (numpy.random)
        leaf["numpy"] = True
        obj = torch.from_numpy(obj)
    elif not isinstance(obj, torch.Tensor):
        raise TypeError(f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which a shard snapshot "
                        "cannot carry: tensors, DTensors, numbers, str, None, and dicts, lists, tuples of them")
    if obj.layout != torch.strided or str(obj.dtype).removeprefix("torch.") not in _DTYPES:
        raise TypeError(f"{path} is a tensor a shard snapshot cannot carry (layout {obj.layout}, dtype {obj.dtype})")
    leaf.update(dtype=str(obj.dtype).removeprefix("torch."), shape=list(obj.shape),
                nbytes=obj.numel() * obj.element_size(), requires_grad=obj.requires_grad)
    leaves.append(leaf)
    tensors.append(obj)
    return {"T": len(leaves) - 1}


def take_snapshot(state: Any, step: int, rank: int, *, seal: bool = True,
                  buffer: torch.Tensor | None = None) -> Snapshot:
    """Copy ``state`` (its ``DTensor`` values' local shards) into one contiguous CPU buffer, once.

    Called on the training thread after the optimizer step: the copy is done when this returns, so
    training may go on. ``seal=False`` leaves the CRC-32 to :meth:`Snapshot.seal` (another thread).
    ``buffer``: a 1-D uint8 CPU tensor no one reads any more, written into when it has the size needed
    (a fresh buffer's pages are faulted in as it is first written: 100 MB, about 60 ms against 10).

    Raises:
        TypeError: a value a snapshot cannot carry, naming its path (``state['opt']['state'][0]``).
    """
    leaves: list[dict] = []
    tensors: list[torch.Tensor] = []
    tree = _describe(state, "state", leaves, tensors, 0)
    offset = 0
    for leaf in leaves:
        offset = -(-offset // _ALIGN) * _ALIGN
        leaf["offset"] = offset
        offset += leaf["nbytes"]
    payload = buffer if buffer is not None and buffer.numel() == offset else torch.empty(offset, dtype=torch.uint8)
    with torch.no_grad():
        for leaf, t in zip(leaves, tensors):
            if leaf["nbytes"]:
                _view(payload, leaf).copy_(t)
    manifest = json.dumps({"format": FORMAT, "rank": rank, "step": step, "bytes": offset, "tree": tree,
                           "leaves": leaves}, separators=(",", ":")).encode()
    if len(manifest) > MAX_MANIFEST_BYTES:
        raise TypeError(f"the state's manifest is {len(manifest)} bytes, more than {MAX_MANIFEST_BYTES}")
    snap = Snapshot(rank, step, manifest, payload)
    return snap.seal() if seal else snap


def _view(payload: torch.Tensor, leaf: dict) -> torch.Tensor:
    dtype = _DTYPES[leaf["dtype"]]
    chunk = payload[leaf["offset"]:leaf["offset"] + leaf["nbytes"]]
    return (chunk.view(dtype) if chunk.numel() else torch.empty(0, dtype=dtype)).view(leaf["shape"])


def read_manifest(data: bytes, payload_bytes: int) -> dict:
    """The manifest in ``data``, checked against a payload of ``payload_bytes`` bytes.

    Raises:
        ManifestError: larger than :data:`MAX_MANIFEST_BYTES`, not this format's JSON, a leaf with an
        unknown dtype, a shape that does not give its bytes, or bytes outside the payload.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"the manifest is {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"the manifest is not JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(f"the manifest is not a {FORMAT} manifest")
    for key in ("rank", "step", "bytes"):
        if type(manifest.get(key)) is not int:
            raise ManifestError(f"the manifest's {key!r} is not an int")
    if manifest["bytes"] != payload_bytes:
        raise ManifestError(f"the manifest describes {manifest['bytes']} bytes, the payload has {payload_bytes}")
    leaves = manifest.get("leaves")
    if not isinstance(leaves, list):
        raise ManifestError("the manifest has no list of leaves")
    for i, leaf in enumerate(leaves):
        ok = (isinstance(leaf, dict) and leaf.get("dtype") in _DTYPES and isinstance(leaf.get("shape"), list)
              and all(type(n) is int and n >= 0 for n in leaf["shape"])
              and all(type(leaf.get(k)) is int and leaf[k] >= 0 for k in ("offset", "nbytes")))
        if not ok or leaf["nbytes"] != math.prod(leaf["shape"]) * _DTYPES[leaf["dtype"]].itemsize \
                or leaf["offset"] % _ALIGN or leaf["offset"] + leaf["nbytes"] > payload_bytes:
            raise ManifestError(f"the manifest's leaf {i} ({str(leaf)[:200]}) does not fit the payload")
    return manifest


def restore(snap: Snapshot, *, mesh: Any = None, device: str | torch.device = "cpu") -> Any:
    """The state ``snap`` was taken from, to load into a model and optimizer (``load_state_dict``).

    Tensors are new (copies of the snapshot's bytes, on ``device``). A ``DTensor`` comes back as a
    ``DTensor`` on ``mesh`` (the caller's device mesh, the one it was sharded on: checked against the
    manifest's) with its placements and global shape; without ``mesh``, as its local shard.

    Raises:
        SnapshotChecksumError: the bytes or manifest do not have the snapshot's checksum (or it has none).
        ManifestError: see :func:`read_manifest`; or ``mesh`` differs from the one recorded.
    """
    if not snap.verify():
        raise SnapshotChecksumError(f"the snapshot of rank {snap.rank} at step {snap.step} does not have its "
                                    f"checksum ({snap.checksum}): refused")
    manifest = read_manifest(snap.manifest, snap.payload.numel())
    leaves = manifest["leaves"]

    def leaf(i: Any) -> Any:
        if type(i) is not int or not 0 <= i < len(leaves):
            raise ManifestError(f"the manifest names leaf {str(i)[:50]}, which it does not have")
        spec = leaves[i]
        t = _view(snap.payload, spec).to(device=device, copy=True)
        if spec.get("numpy"):
            return t.numpy()
        if "placements" not in spec or mesh is None:
            return t.requires_grad_(bool(spec.get("requires_grad")))
        if list(mesh.shape) != spec["mesh"]["shape"] or mesh.mesh.flatten().tolist() != spec["mesh"]["ranks"]:
            raise ManifestError(f"{spec['path']} was sharded on a mesh {spec['mesh']}, not on {mesh}")
        placements = [_PLACEMENTS[p[0]](*p[1:]) for p in spec["placements"]]
        d = DTensor.from_local(t, mesh, placements, run_check=False, shape=torch.Size(spec["global_shape"]),
                               stride=tuple(spec["global_stride"]))
        return d.requires_grad_(bool(spec.get("requires_grad")))

    def build(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
            raise ManifestError(f"the manifest's tree has a malformed node: {str(node)[:200]}")
        [(kind, value)] = node.items()
        if kind == "v":
            return value
        if kind == "f":
            return float(value)
        if kind == "T":
            return leaf(value)
        if kind == "d" and isinstance(value, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in value):
            return {k: build(v, depth + 1) for k, v in value}
        if kind in ("l", "t") and isinstance(value, list):
            items = [build(v, depth + 1) for v in value]
            return items if kind == "l" else tuple(items)
        raise ManifestError(f"the manifest's tree has a malformed node: {str(node)[:200]}")

    return build(manifest.get("tree"), 0)


_PLACEMENTS = {"S": Shard, "R": Replicate, "P": Partial}


def local_shards(state: Any) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor in ``state``, a ``DTensor`` as its local shard (for comparing)."""
    leaves: list[dict] = []
    tensors: list[torch.Tensor] = []
    _describe(state, "state", leaves, tensors, 0)
    return [(leaf["path"], t) for leaf, t in zip(leaves, tensors)]


# -- replication ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class HeldCopy:
    """What :meth:`ShardReplicas.held` reports per rank whose copy this rank holds."""

    rank: int
    step: int
    checksum_ok: bool


@dataclass
class _Stats:
    #: snapshots sealed and sent to every partner still reachable
    sent: int = 0
    received: int = 0
    #: snapshots replaced before they were sent (the previous send was still going)
    replaced: int = 0
    #: copies received whose checksum did not match (the older copy was kept)
    refused: int = 0
    errors: list[str] = field(default_factory=list)


class ShardReplicas:
    """Keep this rank's shard in its partners' CPU memory, and theirs in this rank's.

    Made on every rank (collective: it gathers hostnames and makes a gloo group). Call :meth:`step`
    after every optimizer step, on every rank; :meth:`stop` on every rank at the end.

    Args:
        hosts: each rank's host (``hosts[r]``); default: every rank's ``socket.gethostname()``, gathered.
        replicate_every: snapshot and send every this many steps (>= 1; default 1, every step).
        partners: copies of each shard, each on another rank (1 .. world size - 1; default 1).
        enabled: ``False``: :meth:`step` does nothing and no group or thread is made.
        timeout: bound on each send and receive of the replicas' gloo group.

    Raises:
        ValueError: a setting out of its range, naming it and the range.
    """

    def __init__(self, hosts: Sequence[str] | None = None, *, replicate_every: int = 1, partners: int = 1,
                 enabled: bool = True, timeout: timedelta = timedelta(minutes=5)) -> None:
        if type(replicate_every) is not int or replicate_every < 1:
            raise ValueError(f"ShardReplicas(replicate_every={replicate_every!r}): an int >= 1 (1: every step)")
        if type(partners) is not int or partners < 1:
            raise ValueError(f"ShardReplicas(partners={partners!r}): an int from 1 to the world size - 1")
        if type(enabled) is not bool:
            raise ValueError(f"ShardReplicas(enabled={enabled!r}): True or False")
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"ShardReplicas(timeout={timeout!r}): a positive timedelta")
        self.replicate_every, self.partners, self.enabled = replicate_every, partners, enabled
        self.stats = _Stats()
        self._own: Snapshot | None = None
        self._held: dict[int, Snapshot] = {}
        self._pending: Snapshot | None = None
        #: a buffer no snapshot uses any more, for the next (see :func:`_unused`)
        self._spare: torch.Tensor | None = None
        self._cond = threading.Condition()
        self._stopping = self._sending = False
        self._threads: list[threading.Thread] = []
        if not enabled:
            return
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if partners >= world:
            raise ValueError(f"ShardReplicas(partners={partners}): from 1 to the world size - 1 ({world - 1})")
        if hosts is None:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, socket.gethostname())
            hosts = [str(h) for h in gathered]
        if len(hosts) != world:
            raise ValueError(f"ShardReplicas(hosts=<{len(hosts)} names>): one host per rank ({world})")
        chosen = choose_partners(hosts, partners)
        self.to = chosen[self.rank]
        self.holds = held_by(chosen, self.rank)
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        for target, name in ((self._send_loop, "send"), (self._receive_loop, "receive")):
            thread = threading.Thread(target=target, name=f"fth-shard-replicas-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def step(self, state: Any, step: int) -> bool:
        """After the optimizer step ``step``: copy ``state`` (every ``replicate_every``-th step) and hand
        it to the sending thread; returns at once after the copy (``True`` when one was taken). A
        snapshot still waiting to be sent is replaced by this one (``stats.replaced``)."""
        if not self.enabled or step % self.replicate_every:
            return False
        with self._cond:
            spare, self._spare = self._spare, None
        snap = take_snapshot(state, step, self.rank, seal=False, buffer=spare)
        with self._cond:
            if self._stopping:
                raise RuntimeError("ShardReplicas.step() after stop()")
            if self._pending is not None:
                self.stats.replaced += 1
                self._spare = self._pending.payload  # never handed out
            self._pending = snap
            self._cond.notify_all()
        return True

    def own(self) -> Snapshot | None:
        """This rank's newest sealed snapshot (checksummed, sent or being sent)."""
        with self._cond:
            return self._own

    def copy_of(self, rank: int) -> Snapshot | None:
        """The newest copy held of ``rank``'s shard (its checksum matched on arrival)."""
        with self._cond:
            return self._held.get(rank)

    def held(self, verify: bool = True) -> list[HeldCopy]:
        """(rank, step, checksum ok) of each copy held; ``verify`` recomputes each checksum now."""
        with self._cond:
            held = sorted(self._held.items())
        return [HeldCopy(r, s.step, s.verify() if verify else True) for r, s in held]

    def flush(self, timeout: timedelta = timedelta(seconds=60)) -> bool:
        """Wait until the pending snapshot is sent (for tests and the end of a run); ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._sending,
                                       timeout.total_seconds())

    def stop(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Send what is pending, tell the partners this rank sends no more, wait for the threads
        (every rank calls it: each receiver ends when every rank it holds has said so). A held rank
        that died is seen by the receiving thread only at the group's ``timeout`` (gloo's receive from
        any rank does not end when one connection closes): until then this waits, ``timeout`` at most."""
        if not self.enabled or self._stopping:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout.total_seconds())
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log(logging.WARNING, "shard replicas: %s still running after %.0f s (daemon threads, left)",
                ", ".join(alive), timeout.total_seconds())
        else:
            dist.destroy_process_group(self._group)

    def _send_loop(self) -> None:
        """Seal each pending snapshot (it becomes :meth:`own`) and send it to every partner still
        reachable; a partner whose send failed (gone: its connection closed, or the group's timeout)
        is sent nothing more (logged once), and this rank's snapshots go on being sealed."""
        live = list(self.to)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._stopping)
                snap, self._pending = self._pending, None
                self._sending = snap is not None
            if snap is None:  # stopping, nothing pending
                break
            snap.seal()
            with self._cond:
                old, self._own = self._own, snap
                if _unused(old):
                    self._spare = old.payload
                del old
            header = torch.tensor([_TAG, snap.rank, snap.step, len(snap.manifest), snap.payload.numel(),
                                   snap.checksum], dtype=torch.int64)
            manifest = torch.frombuffer(bytearray(snap.manifest), dtype=torch.uint8)
            for peer in list(live):
                if not self._send(peer, header, manifest, snap.payload):
                    live.remove(peer)
            del snap  # (no name left on the payload: see _unused)
            with self._cond:
                self.stats.sent += 1
                self._sending = False
                self._cond.notify_all()
        stop = torch.tensor([_TAG, self.rank, _STOP, 0, 0, 0], dtype=torch.int64)
        for peer in live:
            self._send(peer, stop)

    def _send(self, peer: int, *tensors: torch.Tensor) -> bool:
        try:
            for t in tensors:
                if t.numel():
                    dist.send(t, peer, group=self._group)
            return True
        except Exception as e:  # a partner gone: training goes on; it is sent nothing more
            self.stats.errors.append(f"send to rank {peer}: {type(e).__name__}: {e}")
            log(logging.WARNING, "shard replicas: sending to rank %d failed, nothing more is sent to it: %s",
                peer, e)
            return False

    def _receive_loop(self) -> None:
        waiting = set(self.holds)
        spares: dict[int, torch.Tensor] = {}  # per held rank, the buffer of a copy replaced and unused
        header = torch.zeros(_HEADER, dtype=torch.int64)
        while waiting:
            try:
                src = dist.recv(header, group=self._group)  # from any rank (its global rank)
                tag, rank, step, mlen, plen, crc = header.tolist()
                if tag != _TAG or src not in waiting or rank != src or not 0 <= mlen <= MAX_MANIFEST_BYTES \
                        or plen < 0:
                    raise ManifestError(f"a malformed header from rank {src}: {header.tolist()}")
                if step == _STOP:
                    waiting.discard(src)
                    continue
                manifest = torch.empty(mlen, dtype=torch.uint8)
                spare = spares.pop(src, None)
                payload = spare if spare is not None and spare.numel() == plen else torch.empty(plen, dtype=torch.uint8)
                del spare
                dist.recv(manifest, src, group=self._group)
                if plen:
                    dist.recv(payload, src, group=self._group)
            except Exception as e:  # a held rank gone (timeout, connection closed): what is held stays
                self.stats.errors.append(f"receive: {type(e).__name__}: {e}")
                log(logging.WARNING, "shard replicas: receiving stopped: %s: %s", type(e).__name__, e)
                return
            snap = Snapshot(rank, step, manifest.numpy().tobytes(), payload, crc)
            del payload
            if not snap.verify():
                self.stats.refused += 1
                spares[rank] = snap.payload
                log(logging.WARNING, "shard replicas: the copy of rank %d at step %d does not have its checksum: "
                    "refused (the copy of step %s kept)", rank, step, getattr(self._held.get(rank), "step", None))
                continue
            with self._cond:
                old, self._held[rank] = self._held.get(rank), snap
                self.stats.received += 1
                self._cond.notify_all()
            if _unused(old):
                spares[rank] = old.payload
            del old, snap


def _unused(snap: Snapshot | None) -> bool:
    """True if nothing but the caller's one name refers to ``snap`` and its payload (no caller of
    :meth:`ShardReplicas.own` or :meth:`~ShardReplicas.copy_of` kept it): its buffer can be written
    again. CPython's reference counts: the argument and the caller's name make 3 for ``snap``."""
    return snap is not None and sys.getrefcount(snap) <= 3 and sys.getrefcount(snap.payload) <= 2
