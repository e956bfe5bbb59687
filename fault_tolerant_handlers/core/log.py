"""Logging with the rank (and, where known, the step) in front of every message."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("fault_tolerant_handlers")


_last_rank: str | None = None  # the rank as last seen in an initialized group (kept after teardown)


def _rank() -> str:
    global _last_rank
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            _last_rank = str(dist.get_rank())
            return _last_rank
    except Exception:  # pragma: no cover - logging must never raise
        pass
    return _last_rank or os.environ.get("RANK", "?")


def prefix(step: int | None = None) -> str:
    """``[rank 1]`` or ``[rank 1 step 17]``."""
    if step is None:
        return f"[rank {_rank()}]"
    return f"[rank {_rank()} step {step}]"


def log(level: int, msg: str, *args: object, step: int | None = None) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, f"{prefix(step)} {msg}", *args)


def first_line(text: object, limit: int | None = 200) -> str:
    """The first line of ``text`` (an exception's message), at most ``limit`` characters: what a log
    line or a short reason shows of an error."""
    return (str(text).splitlines() or [""])[0][:limit]
