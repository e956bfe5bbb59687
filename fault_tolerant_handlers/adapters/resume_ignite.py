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

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from ignite.handlers import DiskSaver
from ignite.handlers.checkpoint import BaseSaveHandler

from ..core import interrupts, sharded
from ..core.log import log
from ..data.loader import RestartableDataLoader
from ..data import dcp, snapshots

__all__ = ["DCPSaver", "SafeDiskSaver", "check_mid_epoch_resume"]


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


class DCPSaver(BaseSaveHandler):
    """A save handler for Ignite's ``Checkpoint`` that writes a distributed checkpoint
    (``torch.distributed.checkpoint``) on **every** rank: a sharded model's shards from each rank
    (Ignite's ``DiskSaver`` writes on one rank only, which loses every other rank's shards).

    Each checkpoint is a directory in ``dirname`` named after Ignite's file name without its
    extension (``checkpoint_20``): every rank writes its shards into ``tmp-checkpoint_20`` first
    (the entries of ``to_save`` holding sharded tensors through DCP, the others, such as the engine
    and the loader, to a file per rank), and rank 0 renames it once DCP has written its
    ``.metadata`` (last, after every rank's shards). Old checkpoints are removed after the new one
    is complete, as :class:`SafeDiskSaver` does. :func:`~fault_tolerant_handlers.latest_checkpoint`
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
                if final.exists():
                    shutil.rmtree(final)
                os.replace(temporary, final)
                for old in pending:
                    if self._name(old) != name:
                        shutil.rmtree(self.dirname / self._name(old), ignore_errors=True)

    def remove(self, filename: str) -> None:
        self._pending_removal.append(filename)


def _loader_next_position(loader: Any) -> tuple[int, int] | None:
    """(epoch, batches already yielded) where the loader's next ``iter()`` starts, if it says."""
    if not isinstance(loader, RestartableDataLoader):
        return None
    state = loader.state_dict()
    if state["epoch_finished"]:
        return state["epoch"] + 1, 0
    return state["epoch"], state["batches_yielded"]


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
        position = _loader_next_position(loader)
        if position is None or position == (epoch, done):
            return None
        message = (f"{where}, but the loader's next iter() starts at batch {position[1]} of its epoch {position[0] + 1}: "
                   "was it left out of Checkpoint.load_objects(to_load=...)? Put the loader in to_save and to_load")
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    log(logging.WARNING, "%s", message, step=iteration)
    return message
