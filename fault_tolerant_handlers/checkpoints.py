"""``latest_checkpoint``: the newest checkpoint to resume from, the same on every rank (the search and
the agreement: :mod:`.data.checkpoints`; a framework's object: :mod:`.adapters.sources`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from .adapters.sources import source_of
from .data.checkpoints import find

__all__ = ["latest_checkpoint"]


def latest_checkpoint(dirname: str | os.PathLike | Any, *, prefix: str | None = None,
                      required_keys: Iterable[str] | Mapping | None = None) -> str | None:
    """The newest complete checkpoint to resume from, or ``None``; the same on every rank. A checkpoint
    is a file, or a distributed checkpoint's directory once complete (its ``.metadata`` written). Torn
    files, leftover temporary files and files that lack a key of ``required_keys`` are skipped with a
    ``RuntimeWarning`` naming them. Call it on every rank, the same number of times, with the same
    folder (or with the trainer), before or after the process group is set up.

    Args:
        dirname: a folder (``str`` or ``os.PathLike``; a missing one gives ``None`` and a warning), or
            what writes the checkpoints: an Ignite ``Engine`` (the files of the ``Checkpoint`` attached
            to it whose ``to_save`` holds it, never a model-only ``best_model_*.pt`` beside them) or
            that ``Checkpoint``, or a Lightning ``Trainer`` (its ``ModelCheckpoint``'s folder, the
            default ``lightning_logs/version_*/checkpoints`` included before ``fit``).
        prefix: only files whose name starts with it (``"training_checkpoint_"``); with an Ignite
            ``Checkpoint`` or ``Engine``, derived from it.
        required_keys: the keys a usable file holds at its top level (Ignite: your ``to_save``, or
            its keys); a file without one is skipped with a warning naming it and the key, checked
            with ``torch.load(weights_only=True, mmap=True)`` (nothing unpickled without the
            restriction). With an Ignite ``Checkpoint`` or ``Engine``, its ``to_save`` keys.

    Examples:
        .. code-block:: python

            # Ignite: the trainer's Checkpoint (setup_common_training_handlers' included)
            if path := latest_checkpoint(trainer):
                Checkpoint.load_objects(to_load=to_save, checkpoint=path)
            trainer.run(loader, max_epochs=3)

            # Lightning (LightningCLI too: cli.trainer), the default ModelCheckpoint folder included
            trainer.fit(model, loader, ckpt_path=latest_checkpoint(trainer))

            # a folder: the same on every rank
            path = latest_checkpoint("ckpts", prefix="training_", required_keys=to_save)

    Raises:
        TypeError: ``dirname``, ``prefix`` or ``required_keys`` is of a kind not listed above.
        ValueError: the ranks passed different folders (every rank raises it, naming each rank's
            folder); an ``Engine`` with no ``Checkpoint`` that saves it, or several; a ``Trainer``
            without a ``ModelCheckpoint``.
        TimeoutError: a rank did not call it within ``FTH_CKPT_AGREE_TIMEOUT_SEC`` (300 s) of rank 0
            (named), or rank 0 gave no answer within twice that.
    """
    return find(source_of(dirname, prefix=prefix, required_keys=required_keys))
