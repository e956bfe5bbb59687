"""``latest_checkpoint`` (the search and the agreement: :mod:`..data.checkpoints`), and what it looks
at when given a framework's object instead of a folder (:func:`source_of`)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..core.hooks import log
from ..data.checkpoints import Source, check_keys, check_prefix, find, folder_source, label_of
from . import compat_ignite, compat_lightning


def _class(module: str, name: str) -> type | None:
    return getattr(sys.modules.get(module), name, None)


def checkpoint_source(checkpoint: Any, prefix: str | None, required_keys: Any) -> Source:
    saver = checkpoint.save_handler
    dirname = getattr(saver, "dirname", None)
    if dirname is None:
        raise TypeError(f"latest_checkpoint(checkpoint): its save_handler is a {type(saver).__name__}, which names "
                        "no folder (a DiskSaver does): pass the folder it writes to")
    to_save = dict(checkpoint.to_save or {})
    if prefix is None and checkpoint.filename_pattern is None:
        name = next(iter(to_save)) if len(to_save) == 1 else "checkpoint"
        prefix = f"{checkpoint.filename_prefix}_{name}_" if checkpoint.filename_prefix else f"{name}_"
    keys = check_keys(required_keys) if required_keys is not None else (tuple(to_save) if len(to_save) > 1 else ())
    prefix = check_prefix(prefix)
    folder = Path(os.path.abspath(os.fspath(dirname)))
    return Source((folder,), label_of(folder, prefix, keys), prefix, keys, compared=False)


def engine_source(engine: Any, prefix: str | None, required_keys: Any) -> Source:
    checkpoint_cls = _class("ignite.handlers.checkpoint", "Checkpoint")
    compat_ignite.check(engine)
    found = [h for h in compat_ignite.attached_handlers(engine) if checkpoint_cls is not None
             and isinstance(h, checkpoint_cls) and any(v is engine for v in (h.to_save or {}).values())]
    if not found:
        raise ValueError("latest_checkpoint(engine): no ignite Checkpoint whose to_save holds this engine is attached "
                         "to it: attach it first (it names the folder and its files), or pass the Checkpoint or the "
                         "folder")
    sources = {checkpoint_source(h, prefix, required_keys) for h in found}
    if len(sources) > 1:
        raise ValueError(f"latest_checkpoint(engine): {len(found)} Checkpoint handlers attached to it save it, to "
                         f"{'; '.join(sorted(s.label for s in sources))}: pass the one to resume from")
    return sources.pop()


def source_of(where: Any, *, prefix: str | None = None, required_keys: Any = None) -> Source:
    if isinstance(where, (str, os.PathLike)):
        return folder_source(where, prefix=prefix, required_keys=required_keys)
    checkpoint_cls = _class("ignite.handlers.checkpoint", "Checkpoint")
    if checkpoint_cls is not None and isinstance(where, checkpoint_cls):
        return checkpoint_source(where, prefix, required_keys)
    engine_cls = _class("ignite.engine.engine", "Engine")
    if engine_cls is not None and isinstance(where, engine_cls):
        return engine_source(where, prefix, required_keys)
    if _is_trainer(where):
        folders, label = compat_lightning.checkpoint_folders(where)
        # a weights-only file (a second ModelCheckpoint(save_weights_only=True) in the same folder) cannot resume fit
        keys = check_keys(required_keys) if required_keys is not None else compat_lightning.RESUME_KEYS
        prefix = check_prefix(prefix)
        return Source(tuple(Path(f) for f in folders), label_of(Path(label), prefix, keys), prefix, keys)
    return folder_source(where)  # raises the TypeError naming the accepted kinds


def _is_trainer(where: Any) -> bool:
    trainers = (_class(ns + ".trainer.trainer", "Trainer") for ns in compat_lightning.NAMESPACES)
    return any(cls is not None and isinstance(where, cls) for cls in trainers)


def _warn_if_finished(path: str, trainer: Any) -> None:
    """Rank 0 says when the checkpoint found is of a fit already over (a new experiment started in an earlier
    one's ``default_root_dir`` finds that one's ``last.ckpt``: ``fit`` would end at once)."""
    if os.environ.get("RANK", "0") != "0" or (why := compat_lightning.finished_fit(path, trainer)) is None:
        return
    message = (f"latest_checkpoint(trainer): {path} is of a finished fit ({why}): fit(ckpt_path=...) ends at "
               "once. For a new experiment, give the Trainer another default_root_dir (or ModelCheckpoint "
               "dirpath), or pass ckpt_path=None")
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log(logging.WARNING, "%s", message)


def latest_checkpoint(dirname: str | os.PathLike | Any, *, prefix: str | None = None,
                      required_keys: Iterable[str] | Mapping | None = None) -> str | None:
    """The newest complete checkpoint to resume from, or ``None``; the same on every rank (call it on every
    rank, the same number of times). Torn or leftover files, and files without a key of ``required_keys``,
    are skipped with a ``RuntimeWarning`` naming them (docs/reference.md). With a ``Trainer``, rank 0 warns
    (``RuntimeWarning``) when the checkpoint found is of a fit already over (its ``max_epochs`` or
    ``max_steps`` reached: a new experiment in an earlier one's folder).

    Args:
        dirname: a folder (``str`` or ``os.PathLike``), or what writes the checkpoints: an Ignite ``Engine``
            or its ``Checkpoint``, a Lightning ``Trainer`` (its ``ModelCheckpoint``'s folder).
        prefix: only files whose name starts with it (with an Ignite object: derived from it).
        required_keys: the top-level keys a usable file holds (with an Ignite object: its ``to_save``'s; with a
            ``Trainer``: ``optimizer_states``, which a weights-only file lacks and ``fit`` needs).

    Examples:
        .. code-block:: python

            if path := latest_checkpoint(trainer):         # Ignite
                Checkpoint.load_objects(to_load=to_save, checkpoint=path)
            trainer.fit(model, loader, ckpt_path=latest_checkpoint(trainer))   # Lightning

    Raises:
        TypeError: an argument of a kind not listed above. ValueError: the ranks passed different folders
            (every rank raises it, naming each rank's); an ``Engine`` with no ``Checkpoint`` that saves it, or
            several; a ``Trainer`` without a ``ModelCheckpoint``. TimeoutError: a rank did not call it within
            ``FTH_CKPT_AGREE_TIMEOUT_SEC`` of rank 0 (named).
    """
    path = find(source_of(dirname, prefix=prefix, required_keys=required_keys))
    if path is not None and _is_trainer(dirname):
        _warn_if_finished(path, dirname)
    return path
