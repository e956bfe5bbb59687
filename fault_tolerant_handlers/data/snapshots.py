"""The newest checkpoint kept in this process's memory while a recovery in place runs, so that the
recovery does not read it back from storage: :func:`keep` copies each one the adapters see written,
:func:`load_checkpoint` hands it over once (docs/recovering.md)."""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..core import attempts, config, sharded
from ..core.phases import RecoveryState
from ..core.hooks import log
from . import live

_lock = threading.Lock()
#: (resolved paths, the copy, its bytes, its stamp): one copy, under every name it was written to in
#: the same round (Lightning writes ``last.ckpt`` beside the step's file: the same global step).
_newest: tuple[frozenset[str], Any, int, tuple | None] | None = None
#: What the last copy cost: seconds and bytes (the bench reads them).
last_cost: tuple[float, int] = (0.0, 0)
_warned_sharded = False


def enabled() -> bool:
    """A recovery in place runs here and ``FTH_SNAPSHOT`` is not ``0``."""
    return attempts.recovering() and config.settings().snapshot


def _copy(obj: Any, sizes: list[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        sizes.append(obj.numel() * obj.element_size())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        copied = {k: _copy(v, sizes) for k, v in obj.items()}
        if type(obj) is not dict:
            copied = type(obj)(copied.items())
        if hasattr(obj, "_metadata"):  # a module's state_dict: the versions its load_state_dict reads
            copied._metadata = copy.deepcopy(obj._metadata)
        return copied
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_copy(v, sizes) for v in obj)
    return copy.deepcopy(obj)


def keep(path: str | os.PathLike, checkpoint: Any) -> bool:
    """``checkpoint`` is being written to ``path``: keep a copy (the newest only). Never raises."""
    global _newest, last_cost, _warned_sharded
    try:
        if not enabled():
            return False
        found = sharded.find(checkpoint, "checkpoint")
        if found is not None:  # not copied (a WARNING, once per process)
            with _lock:
                _newest = None
            if not _warned_sharded:
                _warned_sharded = True
                log(logging.WARNING, "not keeping checkpoint %s in memory: %s is %s; a recovery in place reads it "
                    "where it was written", Path(path).name, *found)
            return False
        lightning = isinstance(checkpoint, dict) and isinstance(checkpoint.get("global_step"), int)
        stamp = (checkpoint.get("epoch"), checkpoint["global_step"]) if lightning else None  # one copy per step
        with _lock:
            if _newest is not None and stamp is not None and _newest[3] == stamp:
                _newest = (_newest[0] | {live._key(path)}, *_newest[1:])
                return True
        start, sizes = time.perf_counter(), []
        copied = _copy(checkpoint, sizes)
        with _lock:
            _newest = (frozenset({live._key(path)}), copied, sum(sizes), stamp)
        last_cost = (time.perf_counter() - start, sum(sizes))
        return True
    except Exception as err:  # noqa: BLE001 - the file is the fallback
        log(logging.DEBUG, "not keeping checkpoint %s in memory: %s", path, err)
        with _lock:
            _newest = None
        return False


def forget() -> None:
    global _newest
    with _lock:
        _newest = None


def end_recovery(state: RecoveryState) -> None:
    """``END``: the newest checkpoint's copy in memory and the live state: no attempt will read them now."""
    forget()
    live.forget()


def newest(path: str | os.PathLike, *, take: bool = False) -> Any | None:
    """The copy kept for ``path`` (or the live state for its name), or ``None``; ``take``: handed over
    once (the loader may update its tensors in place)."""
    global _newest
    state = live.take(path) if take else live.newest(path)
    if state is not None:
        return state
    with _lock:
        kept = _newest
        if kept is None or live._key(path) not in kept[0]:
            return None
        if take:
            _newest = None
    if take:
        log(logging.INFO, "checkpoint %s read from this process's memory", Path(path).name)
    return kept[1]


def take(path: str | os.PathLike) -> Any | None:
    """:func:`newest`, handed over once."""
    return newest(path, take=True)


def load_checkpoint(path: str | os.PathLike, **torch_load_kwargs: Any) -> Any:
    """The checkpoint at ``path``: after a recovery in place, the live state or this process's copy
    in memory, each handed over once; else ``torch.load(path, **torch_load_kwargs)``.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_checkpoint(path={path!r}): expected a file's path (a str or os.PathLike, such as "
                        "latest_checkpoint's answer)")
    kept = take(path)
    if kept is not None:
        return kept
    if Path(path).is_dir():
        raise IsADirectoryError(
            f"load_checkpoint({str(path)!r}): a directory, a distributed checkpoint (torch.distributed.checkpoint) "
            "that torch.load cannot read: load it into your objects on every rank with "
            "fault_tolerant_handlers.load_dcp(to_load, path) (Lightning: trainer.fit(ckpt_path=path))")
    return torch.load(path, **torch_load_kwargs)
