"""Checkpoint writes under way in the main thread, which a reported exit and the interrupt of a hung
main thread wait for, and the learned hang deadline judges as a ``"checkpoint"``."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from ..core import interrupts

_writes_in_progress = 0
_writes_lock = threading.Lock()


@contextlib.contextmanager
def writing_checkpoint() -> Iterator[None]:
    """Mark a block that writes a checkpoint: a reported exit (``FTH_WRITE_GRACE_SEC``) and the interrupt
    of a hung main thread (a :class:`~fault_tolerant_handlers.deferred_interrupt` section) wait for it.
    ``torch.save``, Lightning's ``save_checkpoint`` and Ignite's ``DiskSaver`` are recognised without it."""
    global _writes_in_progress
    with _writes_lock:
        _writes_in_progress += 1
    try:
        with interrupts.SECTION:
            yield
    finally:
        with _writes_lock:
            _writes_in_progress -= 1


_WRITE_FUNCTIONS = ("save_checkpoint", "_save_checkpoint")


def writing_now(frame) -> bool:
    return bool(_writes_in_progress) or stack_writes(frame)


def stack_writes(frame) -> bool:
    """True when the stack from ``frame`` outwards is inside a checkpoint write it shows (``torch.save``,
    a ``save_checkpoint``, Ignite's ``DiskSaver``)."""
    while frame is not None:
        code = frame.f_code
        name, path = code.co_name, code.co_filename
        if name in _WRITE_FUNCTIONS:
            return True
        if name in ("save", "_save", "_legacy_save") and path.endswith(f"torch{os.sep}serialization.py"):
            return True
        if path.endswith(f"ignite{os.sep}handlers{os.sep}checkpoint.py") and name in ("__call__", "_save_func"):
            if type(frame.f_locals.get("self")).__name__ == "DiskSaver":
                return True
        frame = frame.f_back
    return False
