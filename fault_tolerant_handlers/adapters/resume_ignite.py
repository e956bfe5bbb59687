"""Ignite: a mid-epoch resume must find its loader where the engine's state says the epoch is.

Ignite 0.5 resumes a run loaded from a checkpoint at ``state.iteration`` by counting the epoch's
iterations from ``iteration % epoch_length``, but it draws them from a fresh ``iter()`` of the
loader. A loader that does not resume (a plain ``DataLoader``; a ``RestartableDataLoader`` left out
of ``Checkpoint.load_objects(to_load=...)``) gives the *first* batches of the epoch again: the run
goes on, on other samples than an uninterrupted one. Lightning warns in that case; Ignite does not.
This check runs at ``Events.STARTED`` (before Ignite calls ``iter()``; public API only) and warns,
naming the iteration, what the loader will do and how to fix it.

Ignite's ``Checkpoint`` also removes the oldest of its ``n_saved`` files *before* it writes the
new one (``Checkpoint.__call__``, pytorch-ignite 0.5.5): a kill during that write leaves one
complete checkpoint fewer, and with the default ``n_saved=1`` none at all, so the restart begins
from scratch. :class:`SafeDiskSaver` writes first and removes after.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from ignite.handlers import DiskSaver
from ignite.handlers.checkpoint import BaseSaveHandler
from torch.nn.parallel import DistributedDataParallel

from ..core import interrupts, sharded
from ..core.log import log
from ..data.ddp_buckets import DDPBucketLayout
from ..data.loader import RestartableDataLoader
from ..data import dcp, live, snapshots
from . import compat_ignite as _compat_ignite

__all__ = ["DCPSaver", "LAYOUT_KEY", "SafeDiskSaver", "add_bucket_layouts", "check_mid_epoch_resume", "give_bucket_layout"]

#: The key of a DDP's bucket layout in a checkpoint written through an Ignite ``Checkpoint`` whose
#: ``to_save`` holds the DDP (or the model it wraps) and no ``DDPBucketLayout`` of its own.
LAYOUT_KEY = "fault_tolerance_ddp_buckets"


class SafeDiskSaver(DiskSaver):
    """Ignite's ``DiskSaver`` (same arguments) that removes old checkpoints only once the new one is written.

    ``Checkpoint`` asks its save handler to remove the oldest file before it saves the new one; a
    kill in between would cost a checkpoint (with ``n_saved=1``, the only one). Here the removal
    waits until the new file is complete on disk (``DiskSaver`` writes it to a temporary file and
    renames it), so a kill at any moment leaves at least ``n_saved`` complete checkpoints once that
    many were written, and :func:`~fault_tolerant_handlers.latest_checkpoint` finds the newest.
    Recovering in place, the interrupt of a hung main thread waits until the write and the removal
    are over (a :class:`~fault_tolerant_handlers.deferred_interrupt` section).

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers.ignite import SafeDiskSaver

            saver = Checkpoint(to_save, SafeDiskSaver("ckpts", require_empty=False), n_saved=2)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fth_pending_removal: list[str] = []

    def __call__(self, checkpoint: Any, filename: str, metadata: Any = None) -> None:
        # Recovering in place, the interrupt of a hung main thread waits until the file is written
        # and the old ones removed (a deferred section, bounded by FTH_INTERRUPT_DEFER_SEC).
        with interrupts.SECTION:
            found = sharded.find(checkpoint, "checkpoint")
            if found is not None:
                raise TypeError(f"SafeDiskSaver: {found[0]} is {found[1]}: a saver that writes on rank "
                                f"{self.save_on_rank} only would keep that rank's shards alone; save a sharded model "
                                "with fault_tolerant_handlers.ignite.DCPSaver (every rank writes its shards)")
            super().__call__(checkpoint, filename, metadata)  # raises (or is killed): nothing is removed
            snapshots.keep(self.dirname / filename, checkpoint)  # recovering in place: read from memory
            pending, self._fth_pending_removal = self._fth_pending_removal, []
            for name in pending:
                if name != filename:  # the same name saved again: the new file replaced it already
                    super().remove(name)

    def remove(self, filename: str) -> None:
        self._fth_pending_removal.append(filename)


def _discard(path: Path, then: Callable[[], None] = lambda: None) -> None:
    """Remove the directory ``path`` (if there), renamed first to a temporary name ``latest_checkpoint``
    skips (``tmp-<name>.old``: a kill inside the removal never leaves a complete-looking checkpoint with
    files missing), and call ``then`` between the rename and the removal."""
    trash = path.with_name(f"tmp-{path.name}.old")
    shutil.rmtree(trash, ignore_errors=True)  # a removal a killed attempt left
    if path.exists():
        os.replace(path, trash)
    then()
    shutil.rmtree(trash, ignore_errors=True)


class DCPSaver(BaseSaveHandler):
    """A save handler for Ignite's ``Checkpoint`` that writes a distributed checkpoint
    (``torch.distributed.checkpoint``) on **every** rank: a sharded model's shards from each rank
    (Ignite's ``DiskSaver`` writes on one rank only, which loses every other rank's shards).

    Each checkpoint is a directory in ``dirname`` named after Ignite's file name without its
    extension (``checkpoint_20``): every rank writes its shards into ``tmp-checkpoint_20`` first
    (the entries of ``to_save`` holding sharded tensors through DCP, the others, such as the engine
    and the loader, to a file per rank), and rank 0 renames it once DCP has written its
    ``.metadata`` (last, after every rank's shards). Old checkpoints are removed after the new one
    is complete, as :class:`SafeDiskSaver` does, each renamed to ``tmp-<name>.old`` first (a kill in
    the removal never leaves a complete-looking directory with files missing). :func:`~fault_tolerant_handlers.latest_checkpoint`
    finds the newest complete one; :func:`~fault_tolerant_handlers.load_dcp` loads it on every rank.
    ``dirname`` must be one folder every rank sees (a shared file system across hosts).

    Put the model and its optimizers in ``to_save`` as a
    :class:`~fault_tolerant_handlers.ShardedState` (torch's ``get_state_dict`` /
    ``set_state_dict``: an optimizer that has not stepped yet can be loaded into).

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers import ShardedState, latest_checkpoint, load_dcp
            from fault_tolerant_handlers.ignite import DCPSaver

            to_save = {"app": ShardedState(model, optimizer), "trainer": trainer, "loader": loader}
            trainer.add_event_handler(Events.ITERATION_COMPLETED(every=10),
                                      Checkpoint(to_save, DCPSaver("ckpts"), n_saved=2))
            path = latest_checkpoint("ckpts")      # a directory, the same on every rank
            if path:
                load_dcp(to_save, path)            # every rank

    Args:
        dirname: the checkpoint directory (made if missing).
    """

    def __init__(self, dirname: str | os.PathLike) -> None:
        if not isinstance(dirname, (str, os.PathLike)):
            raise TypeError(f"DCPSaver(dirname={dirname!r}): expected a str or os.PathLike")
        self.dirname = Path(dirname).expanduser()
        self._pending_removal: list[str] = []

    @staticmethod
    def _name(filename: str) -> str:
        stem, ext = os.path.splitext(filename)
        return stem if ext in (".pt", ".pth") else filename

    def __call__(self, checkpoint: Any, filename: str, metadata: Any = None) -> None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        name = self._name(filename)
        final, temporary = self.dirname / name, self.dirname / f"tmp-{name}"
        with interrupts.SECTION:
            if rank == 0:
                self.dirname.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(temporary, ignore_errors=True)  # a write a killed attempt left
                temporary.mkdir()
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            dcp.save_dcp(checkpoint, temporary)  # collective; returns once .metadata is written
            pending, self._pending_removal = self._pending_removal, []
            if rank == 0:
                _discard(final, then=lambda: os.replace(temporary, final))  # the new one in place before any goes
                for old in pending:
                    if self._name(old) != name:
                        _discard(self.dirname / self._name(old))

    def remove(self, filename: str) -> None:
        self._pending_removal.append(filename)


def _loader_next_batch(loader: Any) -> int | None:
    """The batch of its pass the loader's next ``iter()`` starts at (0: a new pass), if it says.

    Only the batch is compared with the engine's: the loader counts every ``iter()`` as a pass (an
    evaluator run over the training loader is one too), so its pass number is not the engine's epoch.
    """
    if not isinstance(loader, RestartableDataLoader):
        return None
    state = loader.state_dict()
    return 0 if state["epoch_finished"] else state["batches_yielded"]


def check_mid_epoch_resume(engine: Any) -> str | None:
    """Warn when ``engine`` resumes inside an epoch and its loader will not continue there; return the warning."""
    state = engine.state
    length, iteration, loader = state.epoch_length, state.iteration, state.dataloader
    if not length or not iteration or iteration % length == 0 or loader is None:
        return None
    epoch, done = divmod(iteration, length)
    where = f"the engine resumes at iteration {iteration} (batch {done} of epoch {epoch + 1}, epoch_length {length})"
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        message = (f"{where}, but its data ({type(loader).__name__}) has no state_dict/load_state_dict: Ignite will "
                   f"draw the remaining {length - done} iterations from the start of the epoch, not the batches an "
                   "uninterrupted run trains. Use fault_tolerant_handlers.RestartableDataLoader (or make_restartable) "
                   "and put it in the checkpoint's to_save / to_load")
    else:
        batch = _loader_next_batch(loader)
        if batch is None or batch == done:
            return None
        start = "batch 0 (a new pass over the data)" if batch == 0 else f"batch {batch}"
        message = (f"{where}, but the loader's next iter() starts at {start}: was it left out of "
                   "Checkpoint.load_objects(to_load=...)? Put the loader in to_save and to_load")
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    log(logging.WARNING, "%s", message, step=iteration)
    return message


# -- a DDP's bucket layout beside the model ---------------------------------------------------------------
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log(logging.WARNING, "%s", message)


def find_ddp(objects: Iterable[Any]) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` among ``objects`` or, when they hold the model it wraps (its
    ``.module``), that DDP: named by the training step of an ``Engine`` among them, or, from 3 ranks
    on (at 2 both layouts give the same bits), found among the live objects (a scan of the heap:
    about 0.1 s, only when nothing else names it)."""
    objects = list(objects)
    for obj in objects:
        if isinstance(obj, DistributedDataParallel):
            return obj
    modules = [obj for obj in objects if isinstance(obj, torch.nn.Module)]
    if not modules:
        return None

    def wraps(value: Any) -> bool:
        return isinstance(value, DistributedDataParallel) and any(value.module is m for m in modules)

    from ignite.engine import Engine

    for engine in (obj for obj in objects if isinstance(obj, Engine)):
        found = next((v for v in _compat_ignite.step_names(engine) if wraps(v)), None)
        if found is not None:
            return found
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() >= 3):
        return None
    return next((obj for obj in gc.get_objects() if type(obj) is DistributedDataParallel and wraps(obj)), None)


def _layout_of(ddp: DistributedDataParallel) -> DDPBucketLayout | None:
    """The one ``DDPBucketLayout`` of ``ddp`` (kept on it: the layout a load gave it is what it saves)."""
    layout = getattr(ddp, "_fth_bucket_layout", None)
    if layout is None:
        try:
            layout = ddp._fth_bucket_layout = DDPBucketLayout(ddp)
        except RuntimeError as err:  # this torch lacks a name the layout needs: named once
            _warn_once(f"the DDP's bucket layout is not saved with the checkpoint ({err}): a resume at 3 ranks or "
                       "more may differ from the uninterrupted run in the last bits")
    return layout


def add_bucket_layouts(engine: Any, checkpoints: Iterable[Any]) -> None:
    """``STARTED``: each of ``checkpoints`` (``Checkpoint`` handlers attached to ``engine``) whose
    ``to_save`` holds a DDP (or the model it wraps) and no ``DDPBucketLayout`` saves the DDP's layout
    too, under :data:`LAYOUT_KEY`. The handler gets a new dict (the user's ``to_save`` is left as it is:
    it loads the checkpoints); a ``to_save`` of one object is left as it is (Ignite saves that object's
    ``state_dict`` alone, not a dict of them)."""
    for handler in checkpoints:
        to_save = handler.to_save
        if not isinstance(to_save, dict) or len(to_save) < 2 or LAYOUT_KEY in to_save or any(
                isinstance(obj, DDPBucketLayout) for obj in to_save.values()):
            continue
        ddp = find_ddp([*to_save.values(), engine])
        layout = _layout_of(ddp) if ddp is not None else None
        if layout is not None:
            handler.to_save = {**to_save, LAYOUT_KEY: layout}


def give_bucket_layout(to_load: Any, checkpoint: Any) -> None:
    """After ``Checkpoint.load_objects(to_load, checkpoint)``: the checkpoint's DDP bucket layout (saved
    under :data:`LAYOUT_KEY`) goes to the DDP of ``to_load`` (or of the model it holds), before its
    first step. Nothing for a checkpoint without one (written by an earlier version, or at 1 object)."""
    if not isinstance(checkpoint, dict) or not isinstance(to_load, dict) or LAYOUT_KEY in to_load:
        return
    saved = checkpoint.get(LAYOUT_KEY)
    if not isinstance(saved, dict) or saved.get("buckets") is None:
        return
    ddp = find_ddp(to_load.values())
    layout = _layout_of(ddp) if ddp is not None else None
    if layout is None:
        return
    try:
        layout.load_state_dict(saved)
    except (RuntimeError, ValueError) as err:
        _warn_once(f"the checkpoint's DDP bucket layout is not used ({err}): a resume at 3 ranks or more may "
                   "differ from the uninterrupted run in the last bits")


def _read(path: Any) -> Any:
    """What ``Checkpoint.load_objects`` reads for a path that is not a live state's name."""
    return torch.load(path, weights_only=True)


def hook_load_objects() -> None:
    """Once per process: every ``Checkpoint.load_objects`` gives a DDP its checkpoint's bucket layout."""
    _compat_ignite.hook_load_objects(take=live.take, read=_read, after=give_bucket_layout)
