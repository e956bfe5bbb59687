"""Sharded state: tensors a process does not hold whole (``DTensor``: FSDP2's ``fully_shard``,
tensor parallelism, Lightning's ``ModelParallelStrategy``; any tensor subclass without memory of
its own). Every path of the library that reads a tensor's bytes, copies a state or sends it asks
here first and refuses such a tensor with a reason that names its type: reading it in place would
read address 0 (a ``DTensor``'s ``data_ptr()`` is 0), and a copy of one rank's shards is not the
model's state."""

from __future__ import annotations

from typing import Any

import torch


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


def in_module(module: torch.nn.Module) -> str:
    """Why ``module``'s parameters or buffers are sharded ("" when none is)."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        why = unbacked(tensor)
        if why:
            return f"its {name} is {why}"
    return ""
