"""Sharded state: tensors a process does not hold whole (``DTensor``: FSDP2's ``fully_shard``,
tensor parallelism, Lightning's ``ModelParallelStrategy``; any tensor subclass without memory of its
own), and snapshots of one rank's part of such a state.

Every path of the library that reads a tensor's bytes, copies a state or sends it asks
:func:`unbacked` first and refuses such a tensor, naming its type (a ``DTensor``'s ``data_ptr()`` is 0).
:func:`take_snapshot` copies a rank's state dict (``DTensor`` values' local shards, tensors, numbers)
once into one CPU buffer with a CRC-32 over it and its manifest (bounded JSON, never pickle: the bytes
may come from a peer); :func:`restore` (:func:`rebuild`: on the mesh of the model it is loaded into)
refuses one whose checksum does not match (:class:`SnapshotChecksumError`) or whose manifest is
malformed (:class:`ManifestError`). A recovery in place keeps each rank's own shard so
(:mod:`..data.live`); :class:`~..recover.replicas.ShardReplicas` sends it to partners.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

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


class ManifestError(ValueError):
    """A snapshot's manifest is malformed, too large or does not fit its bytes: nothing is rebuilt."""


class SnapshotChecksumError(ValueError):
    """A snapshot's bytes do not have the checksum it was sent with: it is never loaded."""


def unbacked(tensor: torch.Tensor) -> str:
    """Why ``tensor`` is not a tensor this process holds whole ("" when it is one)."""
    name = type(tensor).__qualname__
    if name == "DTensor" or hasattr(tensor, "device_mesh") and hasattr(tensor, "placements"):
        placements = ", ".join(str(p) for p in getattr(tensor, "placements", ()))
        return (f"a DTensor (sharded: placements ({placements}) over a mesh of "
                f"{getattr(getattr(tensor, 'device_mesh', None), 'size', lambda: '?')()} ranks)")
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and tensor.numel() and not tensor.is_meta:
        try:
            if tensor.data_ptr() == 0:
                return f"a {type(tensor).__module__}.{name} without memory of its own (data_ptr() is 0)"
        except RuntimeError as err:
            return f"a {type(tensor).__module__}.{name} whose memory cannot be read ({err})"
    return ""


def find(obj: Any, path: str = "state", depth: int = 0) -> tuple[str, str] | None:
    """``(path, why)`` of the first sharded tensor (:func:`unbacked`) in a nested state (dicts,
    lists, tuples), or ``None``."""
    if isinstance(obj, torch.Tensor):
        why = unbacked(obj)
        return (path, why) if why else None
    if depth > 64:
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = find(value, f"{path}[{key!r}]", depth + 1)
        if found is not None:
            return found
    return None


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


def rebuild(state: Any, objects: Iterable[Any]) -> Any:
    """``state`` as ``objects`` load it: a :class:`Snapshot` restored on the mesh and device of the first
    ``DTensor`` parameter of a module among ``objects`` (or their ``.model``: ``ShardedState``).

    Raises:
        TypeError: a snapshot, and no sharded model among ``objects``.
        SnapshotChecksumError, ManifestError: see :func:`restore`.
    """
    if not isinstance(state, Snapshot):
        return state
    objects = list(objects)
    models = [m for obj in objects for m in (obj, getattr(obj, "model", None)) if isinstance(m, torch.nn.Module)]
    for param in (p for m in models for p in m.parameters() if isinstance(p, DTensor)):
        return restore(state, mesh=param.device_mesh, device=param.to_local().device)
    raise TypeError(f"the live state of step {state.step} is this rank's shard of a sharded model, and no sharded "
                    f"model is among the objects it is loaded into ({', '.join(type(o).__name__ for o in objects)}): "
                    "load it with load_dcp(to_load, path) or Checkpoint.load_objects(to_load, path)")
