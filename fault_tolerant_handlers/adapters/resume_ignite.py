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
import warnings
from typing import Any

from ignite.handlers import DiskSaver

from ..core import interrupts
from ..core.log import log
from ..data.loader import RestartableDataLoader
from ..data import snapshots

__all__ = ["SafeDiskSaver", "check_mid_epoch_resume"]


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
            super().__call__(checkpoint, filename, metadata)  # raises (or is killed): nothing is removed
            snapshots.keep(self.dirname / filename, checkpoint)  # recovering in place: read from memory
            pending, self._fth_pending_removal = self._fth_pending_removal, []
            for name in pending:
                if name != filename:  # the same name saved again: the new file replaced it already
                    super().remove(name)

    def remove(self, filename: str) -> None:
        self._fth_pending_removal.append(filename)


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
