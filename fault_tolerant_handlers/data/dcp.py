"""Distributed checkpoints (``torch.distributed.checkpoint``, DCP) of sharded models, framework-neutral.

A sharded model (FSDP2's ``fully_shard``, a ``DTensor`` mesh) has no rank that holds its whole state:
each rank writes its own shards, and a checkpoint is a directory (DCP's ``.metadata``, written last
by its coordinator once every rank's shards are written, and one ``.distcp`` file per rank).

* :class:`ShardedState`: a model and its optimizers as one object with ``state_dict`` /
  ``load_state_dict`` (torch's public ``torch.distributed.checkpoint.state_dict``:
  ``get_state_dict`` / ``set_state_dict``: keys by parameter name, shards as ``DTensor``), to put
  in an Ignite ``Checkpoint``'s ``to_save``.
* :func:`save_dcp` / :func:`load_dcp`: what :class:`~fault_tolerant_handlers.ignite.DCPSaver` writes
  and how it is read back into the objects on every rank: the entries that hold sharded tensors
  through DCP, every other entry (the engine's counters, the loader's position) in a file per rank
  (``rank<r>.pt``, ``torch.save``, read with ``weights_only=True``), written before DCP's
  ``.metadata``: a directory with ``.metadata`` is complete.

:func:`~fault_tolerant_handlers.latest_checkpoint` finds such directories beside checkpoint files.
Loading one at another world size than it was written at is not what this module is for (the
per-rank files are per rank): it refuses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from ..core import sharded

__all__ = ["ShardedState", "load_dcp", "save_dcp"]

#: DCP's metadata file: written last (renamed into place by its coordinator), so its presence marks
#: a complete distributed checkpoint.
METADATA = ".metadata"
_INDEX = "fth_sharded_keys"


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class ShardedState:
    """A sharded model and its optimizers as one checkpointable object (``state_dict`` /
    ``load_state_dict``), through torch's ``get_state_dict`` / ``set_state_dict``: the model's
    state by parameter name with its shards (``DTensor``), the optimizers' state keyed by parameter
    name too (an optimizer that has not stepped yet gets its state made first, so that a fresh one
    can be loaded into). Both are collective where FSDP needs it: call them on every rank.

    Examples:
        .. code-block:: python

            to_save = {"app": ShardedState(model, optimizer), "trainer": trainer, "loader": loader}
    """

    def __init__(self, model: torch.nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = ()):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ShardedState(model={type(model).__name__}): expected a torch.nn.Module")
        self.model = model
        self.optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        for optimizer in self.optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"ShardedState(optimizers=...): {type(optimizer).__name__} is not a torch.optim.Optimizer")

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not self.optimizers:
            return {"model": get_model_state_dict(self.model)}
        model, optim = get_state_dict(self.model, self.optimizers)
        return {"model": model, "optimizer": optim}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if not self.optimizers:
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_dcp(checkpoint: Mapping[str, Any], directory: str | os.PathLike) -> None:
    """Write ``checkpoint`` (a dict of states, as Ignite's ``Checkpoint`` hands its saver) into
    ``directory`` (made beforehand, shared by the ranks). Collective: every rank, same order. The
    entries holding sharded tensors go through ``torch.distributed.checkpoint.save``, the others to
    this rank's ``rank<r>.pt`` first (DCP's ``.metadata``, written last, then marks it complete)."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank()
    keys = sorted(str(k) for k, v in checkpoint.items() if sharded.find(v) is not None)
    plain = {k: v for k, v in checkpoint.items() if str(k) not in keys}
    plain[_INDEX] = {"keys": keys, "world_size": world}
    found = sharded.find(plain)  # not reached: entries holding shards went to ``keys``
    assert found is None, found
    torch.save(plain, Path(directory) / _rank_file(rank))
    dcp.save({k: checkpoint[k] for k in keys}, checkpoint_id=str(directory))


def load_dcp(to_load: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Load a distributed checkpoint (a directory :class:`~fault_tolerant_handlers.ignite.DCPSaver`
    wrote) into the objects of ``to_load`` (the ``to_save`` dict of the ``Checkpoint`` that wrote
    it), as Ignite's ``Checkpoint.load_objects`` does for a file. Collective: every rank.

    Raises:
        FileNotFoundError: ``path`` is not a complete distributed checkpoint (no ``.metadata``, or no
            file for this rank).
        ValueError: it was written at another world size, or lacks an entry of ``to_load``.
    """
    import torch.distributed.checkpoint as dcp

    folder = Path(path)
    rank, world = _rank()
    if not (folder / METADATA).is_file() or not (folder / _rank_file(rank)).is_file():
        raise FileNotFoundError(f"load_dcp(path={str(path)!r}): not a complete distributed checkpoint of this library "
                                f"(needs {METADATA} and {_rank_file(rank)})")
    plain = torch.load(folder / _rank_file(rank), map_location="cpu", weights_only=True)
    index = plain.pop(_INDEX, None)
    if not isinstance(index, dict) or index.get("world_size") != world:
        raise ValueError(f"load_dcp(path={str(path)!r}): written by {index.get('world_size') if isinstance(index, dict) else '?'} "
                         f"ranks, loaded by {world}: resume at the world size it was written at")
    keys = list(index.get("keys", []))
    missing = [k for k in to_load if k not in keys and k not in plain]
    if missing:
        raise ValueError(f"load_dcp(to_load=...): the checkpoint {folder.name} has no {missing} "
                         f"(it holds {sorted([*keys, *plain])})")
    objects = {k: (o.module if isinstance(o, torch.nn.parallel.DistributedDataParallel) else o) for k, o in to_load.items()}
    state = {k: objects[k].state_dict() for k in keys if k in objects}
    if state:
        dcp.load(state, checkpoint_id=str(folder))
    for key, obj in objects.items():
        obj.load_state_dict(state[key] if key in state else plain[key])
