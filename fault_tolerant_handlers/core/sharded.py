"""Sharded state (``DTensor``, or any tensor subclass without memory of its own: :func:`unbacked`,
which every path reading a tensor's bytes asks first), and snapshots of one rank's part of it: one CPU
buffer with a CRC-32 over it and its bounded-JSON manifest (never pickle: the bytes may come from a
peer), which :func:`restore` refuses when either is bad."""

from __future__ import annotations

import ctypes
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import rng_state, structure

#: Names the manifest's layout: a change of it changes every checksum.
FORMAT = "fth-shard-2"
#: The largest manifest accepted (bytes of JSON), from a peer or not.
MAX_MANIFEST_BYTES = structure.MAX_BYTES
#: Each leaf's bytes start at a multiple of this (any dtype's view of the buffer is aligned).
_ALIGN = 64


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


def memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, read in place through ctypes (valid while ``t`` lives;
    torch only: numpy is not a dependency)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    if type(t) is not torch.Tensor or t.device.type != "cpu" or not t.data_ptr() or not t.is_contiguous():
        raise TypeError(f"not a contiguous CPU tensor with memory of its own ({type(t).__qualname__} on {t.device})")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def find(obj: Any, path: str = "state", depth: int = 0) -> tuple[str, str] | None:
    """``(path, why)`` of the first sharded tensor (:func:`unbacked`) in a nested state, or ``None``."""
    if isinstance(obj, torch.Tensor):
        return (path, why) if (why := unbacked(obj)) else None
    if depth > structure.MAX_DEPTH or not isinstance(obj, (dict, list, tuple)):
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    return next(filter(None, (find(v, f"{path}[{k!r}]", depth + 1) for k, v in items)), None)


# -- snapshot -------------------------------------------------------------------------------------

@dataclass
class Snapshot:
    """One rank's state at one step: every tensor's bytes in ``payload`` (1-D uint8, CPU), how to rebuild
    them in ``manifest`` (JSON), a CRC-32 over both in ``checksum`` (``None`` until :meth:`seal`)."""

    rank: int
    step: int
    manifest: bytes
    payload: torch.Tensor
    checksum: int | None = None

    def compute_checksum(self) -> int:
        # zlib releases the GIL over large buffers
        return zlib.crc32(memory(self.payload.detach().cpu().contiguous()), zlib.crc32(self.manifest))

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


def _describe(state: Any, rng: Any = None) -> tuple[list, list[dict], list[torch.Tensor]]:
    """``([structure of state, of rng], leaves, tensors)``: a tensor as ``{"T": index}`` into ``leaves``
    (how to rebuild it) and ``tensors`` (its local shard)."""
    leaves: list[dict] = []
    tensors: list[torch.Tensor] = []

    def leaf(obj: Any, path: str) -> Any:
        spec: dict[str, Any] = {"path": path}
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            spec.update(placements=[_placement(p, path) for p in obj.placements], global_shape=list(obj.shape),
                        global_stride=list(obj.stride()), mesh={"shape": list(mesh.shape),
                                                                "dim_names": list(mesh.mesh_dim_names or []),
                                                                "ranks": mesh.mesh.flatten().tolist()})
            obj = obj.to_local()
        elif (array := structure.from_numpy(obj)) is not None:  # RNG states (numpy.random)
            spec["numpy"] = True
            obj = array
        elif not isinstance(obj, torch.Tensor):
            return None
        structure.dense(obj, path, "a shard snapshot")
        spec.update(dtype=structure.dtype_name(obj.dtype), shape=list(obj.shape),
                    nbytes=obj.numel() * obj.element_size(), requires_grad=obj.requires_grad)
        leaves.append(spec)
        tensors.append(obj)
        return {"T": len(leaves) - 1}

    trees = [structure.encode(part, leaf, "a shard snapshot", loose=True, path=name)
             for part, name in ((state, "state"), (rng, "rng"))]
    return trees, leaves, tensors


def take_snapshot(state: Any, step: int, rank: int, *, seal: bool = True,
                  buffer: torch.Tensor | None = None, rng: tuple | None = None) -> Snapshot:
    """Copy ``state`` (``DTensor`` values' local shards) and ``rng`` (:mod:`.rng_state`'s record) into one
    contiguous CPU buffer, done when this returns. ``seal=False`` leaves the CRC-32 to another thread
    (:meth:`Snapshot.seal`); ``buffer``: an unused 1-D uint8 CPU tensor to reuse if it has the size
    (a fresh one's pages fault in as written: 100 MB, about 60 ms against 10). ``TypeError``: a value a
    snapshot cannot carry, naming its path."""
    (tree, rng_tree), leaves, tensors = _describe(state, rng)
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
    manifest = structure.dumps({"format": FORMAT, "rank": rank, "step": step, "bytes": offset, "tree": tree,
                                "rng": rng_tree, "leaves": leaves})
    snap = Snapshot(rank, step, manifest, payload)
    return snap.seal() if seal else snap


def _view(payload: torch.Tensor, leaf: dict) -> torch.Tensor:
    dtype = structure.DTYPES[leaf["dtype"]]
    chunk = payload[leaf["offset"]:leaf["offset"] + leaf["nbytes"]]
    return (chunk.view(dtype) if chunk.numel() else torch.empty(0, dtype=dtype)).view(leaf["shape"])


def read_manifest(data: bytes, payload_bytes: int) -> dict:
    """The manifest in ``data``, checked against a payload of ``payload_bytes`` bytes (else :class:`ManifestError`)."""
    manifest = structure.loads(data, ManifestError)
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
        ok = (isinstance(leaf, dict) and leaf.get("dtype") in structure.DTYPES and isinstance(leaf.get("shape"), list)
              and all(type(n) is int and n >= 0 for n in leaf["shape"])
              and all(type(leaf.get(k)) is int and leaf[k] >= 0 for k in ("offset", "nbytes")))
        if not ok or leaf["nbytes"] != math.prod(leaf["shape"]) * structure.DTYPES[leaf["dtype"]].itemsize \
                or leaf["offset"] % _ALIGN or leaf["offset"] + leaf["nbytes"] > payload_bytes:
            raise ManifestError(f"the manifest's leaf {i} ({str(leaf)[:200]}) does not fit the payload")
    return manifest


def rng_of(snap: Snapshot) -> tuple | None:
    """The RNG states ``snap`` carries (:func:`take_snapshot`'s ``rng``), or ``None``; raises as :func:`restore`."""
    rng = restore(snap, part="rng")
    if rng is None:
        return None
    if (record := rng_state.checked(rng)) is None:
        raise ManifestError(f"the snapshot's RNG states are malformed: {str(rng)[:200]}")
    return record


def restore(snap: Snapshot, *, mesh: Any = None, device: str | torch.device = "cpu", part: str = "tree") -> Any:
    """The state ``snap`` was taken from, in new tensors on ``device``; a ``DTensor`` as a ``DTensor`` on
    ``mesh`` (checked against the manifest's), or without ``mesh`` as its local shard. ``part="rng"``:
    the RNG states it carries instead (:func:`rng_of`).

    Raises:
        SnapshotChecksumError: the bytes or manifest do not have the snapshot's checksum (or it has none).
        ManifestError: see :func:`read_manifest`; or ``mesh`` differs from the one recorded.
    """
    if not snap.verify():
        raise SnapshotChecksumError(f"the snapshot of rank {snap.rank} at step {snap.step} does not have its "
                                    f"checksum ({snap.checksum}): refused")
    manifest = read_manifest(snap.manifest, snap.payload.numel())
    leaves = manifest["leaves"]

    def leaf(tag: str, i: Any, local: Any, path: str) -> Any:
        if tag != "T":
            raise ManifestError(f"the manifest's tree has a malformed node at {path}: {tag!r}")
        if type(i) is not int or not 0 <= i < len(leaves):
            raise ManifestError(f"the manifest names leaf {str(i)[:50]}, which it does not have")
        spec = leaves[i]
        t = _view(snap.payload, spec).to(device=device, copy=True)
        if spec.get("numpy"):
            return t.numpy()
        if "placements" not in spec or mesh is None:
            return t.requires_grad_(bool(spec.get("requires_grad")))
        recorded = spec.get("mesh")
        if not isinstance(recorded, dict) or [list(mesh.shape), mesh.mesh.flatten().tolist()] != [
                recorded.get("shape"), recorded.get("ranks")]:
            raise ManifestError(f"{path} was sharded on a mesh {str(recorded)[:200]}, not on {mesh}")
        try:
            placements = [_PLACEMENTS[p[0]](*p[1:]) for p in spec["placements"]]
            d = DTensor.from_local(t, mesh, placements, run_check=False, shape=torch.Size(spec["global_shape"]),
                                   stride=tuple(spec["global_stride"]))
        except (KeyError, TypeError, IndexError, ValueError, RuntimeError) as e:
            raise ManifestError(f"{path}'s placements do not rebuild it: {type(e).__name__}: {str(e)[:200]}") from None
        return d.requires_grad_(bool(spec.get("requires_grad")))

    return structure.decode(manifest.get(part), leaf, ManifestError)


_PLACEMENTS = {"S": Shard, "R": Replicate, "P": Partial}


def rebuild(state: Any, objects: Iterable[Any]) -> Any:
    """``state`` as ``objects`` load it: a :class:`Snapshot` restored on the mesh and device of the first
    ``DTensor`` parameter of a module among ``objects`` (or their ``.model``). ``TypeError``: no sharded
    model among them; else raises as :func:`restore`."""
    if not isinstance(state, Snapshot):
        return state
    objects = list(objects)
    models = [m for obj in objects for m in (obj, getattr(obj, "model", None)) if isinstance(m, torch.nn.Module)]
    for param in (p for m in models for p in m.parameters() if isinstance(p, DTensor)):
        return restore(state, mesh=param.device_mesh, device=param.to_local().device)
    raise TypeError(f"the live state of step {state.step} is this rank's shard of a sharded model, and no sharded "
                    f"model is among the objects it is loaded into ({', '.join(type(o).__name__ for o in objects)}): "
                    "load it with load_dcp(to_load, path) or Checkpoint.load_objects(to_load, path)")
