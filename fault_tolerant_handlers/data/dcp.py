"""Distributed checkpoints (``torch.distributed.checkpoint``, DCP) of sharded models, framework-neutral
(docs/sharded.md): :class:`ShardedState`, and :func:`save_dcp` / :func:`load_dcp` for what
:class:`~fault_tolerant_handlers.ignite.DCPSaver` saves: sharded entries through DCP, the others in a
``rank<r>.pt`` per rank, written before DCP's ``.metadata`` (last: a directory holding it is complete)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from ..core import sharded
from . import live

__all__ = ["ShardedState", "load_dcp", "load_shards", "save_dcp"]

#: DCP's metadata file, written last: its presence marks a complete distributed checkpoint.
METADATA = ".metadata"
_INDEX = "fth_sharded_keys"


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class ShardedState:
    """A sharded model and its optimizers as one checkpointable object (``state_dict`` /
    ``load_state_dict``) through torch's ``get_state_dict`` / ``set_state_dict``: keys by parameter
    name, shards as ``DTensor``; a fresh optimizer can be loaded into. Collective: call on every rank.

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


def load_shards(model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], model_state: Mapping[str, Any],
                optimizer_states: Iterable[Mapping[str, Any]]) -> None:
    """Load this rank's shards (as torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` give
    them) into ``model`` and each optimizer, a fresh one too. No collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, model_state)
    for optimizer, state in zip(optimizers, optimizer_states, strict=True):
        set_optimizer_state_dict(model, optimizer, state)


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_dcp(checkpoint: Mapping[str, Any], directory: str | os.PathLike) -> None:
    """Write ``checkpoint`` (a dict of states, as Ignite's ``Checkpoint`` hands its saver) into the
    shared ``directory``, made beforehand. Collective: every rank, same order."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank()
    keys = sorted(str(k) for k, v in checkpoint.items() if sharded.find(v) is not None)
    plain = {k: v for k, v in checkpoint.items() if str(k) not in keys}
    plain[_INDEX] = {"keys": keys, "world_size": world}
    torch.save(plain, Path(directory) / _rank_file(rank))
    dcp.save({k: checkpoint[k] for k in keys}, checkpoint_id=str(directory))


def load_dcp(to_load: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Load a distributed checkpoint (a directory :class:`~fault_tolerant_handlers.ignite.DCPSaver`
    wrote) into the objects of ``to_load``, as Ignite's ``Checkpoint.load_objects`` does for a file.
    Collective: every rank. The name ``latest_checkpoint`` gave for live state loads each rank's own.

    Raises:
        FileNotFoundError: ``path`` is not a complete distributed checkpoint (no ``.metadata``, or no
            file for this rank).
        ValueError: it was written at another world size, or lacks an entry of ``to_load``.
    """
    import torch.distributed.checkpoint as dcp

    objects = {k: (o.module if isinstance(o, torch.nn.parallel.DistributedDataParallel) else o) for k, o in to_load.items()}
    state, keys = live.take(path, objects.values()), []  # after a recovery in place: this rank's live state
    if state is None:
        folder = Path(path)
        rank, world = _rank()
        if not (folder / METADATA).is_file() or not (folder / _rank_file(rank)).is_file():
            raise FileNotFoundError(f"load_dcp(path={str(path)!r}): not a complete distributed checkpoint of this "
                                    f"library (needs {METADATA} and {_rank_file(rank)})")
        state = torch.load(folder / _rank_file(rank), map_location="cpu", weights_only=True)
        index = state.pop(_INDEX, None)
        if not isinstance(index, dict) or index.get("world_size") != world:
            raise ValueError(f"load_dcp(path={str(path)!r}): written by {index.get('world_size') if isinstance(index, dict) else '?'} "
                             f"ranks, loaded by {world}: resume at the world size it was written at")
        keys = list(index.get("keys", []))
    missing = [k for k in objects if k not in keys and k not in state]
    if missing:
        raise ValueError(f"load_dcp(to_load=...): {Path(path).name} has no {missing} (it holds {sorted([*keys, *state])})")
    shards = {k: objects[k].state_dict() for k in keys if k in objects}
    if shards:
        dcp.load(shards, checkpoint_id=str(path))
    for key, obj in objects.items():
        obj.load_state_dict(shards[key] if key in shards else state[key])
