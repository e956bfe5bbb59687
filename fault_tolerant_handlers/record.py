"""The failure record a failing rank publishes in the c10d store.

The store is unauthenticated and shared by every process of the job, so a record is plain,
bounded JSON: it is written with caps on every text field and read back with a size limit and a
schema check. A record that is too large, not JSON, or not of the expected shape is ignored with
a warning. Nothing read from the store is ever unpickled or executed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from ._log import log

#: Record format version; a reader ignores records of another version.
RECORD_VERSION = 1
#: Caps on the text fields of a record (characters). The traceback keeps its *tail*: the frames
#: nearest the raise are the ones that explain it.
MAX_MESSAGE_CHARS = 2_000
MAX_TRACEBACK_CHARS = 8_000
MAX_NAME_CHARS = 200
#: A record read back from the store larger than this (bytes) is ignored unread.
MAX_RECORD_BYTES = 16 * 1024


def _cap_head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"


def _cap_tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "...[truncated]...\n" + text[-(limit - 19) :]


def exception_type_name(exc: BaseException) -> str:
    """``ValueError`` for builtins, ``package.module.Name`` otherwise."""
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class FailureRecord:
    """What one rank says about its own failure."""

    rank: int
    exc_type: str
    exc_message: str
    traceback: str
    section: str
    seq: int
    time_ms: int
    pid: int = 0
    host: str = ""
    step: int | None = None
    epoch: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        *,
        rank: int,
        section: str,
        seq: int,
        step: int | None = None,
        epoch: int | None = None,
        time_ms: int | None = None,
    ) -> FailureRecord:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(
            rank=rank,
            exc_type=_cap_head(exception_type_name(exc), MAX_NAME_CHARS),
            exc_message=_cap_head(str(exc), MAX_MESSAGE_CHARS),
            traceback=_cap_tail(tb, MAX_TRACEBACK_CHARS),
            section=_cap_head(section, MAX_NAME_CHARS),
            seq=seq,
            time_ms=int(time.time() * 1000) if time_ms is None else time_ms,
            pid=os.getpid(),
            host=_cap_head(socket.gethostname(), MAX_NAME_CHARS),
            step=step,
            epoch=epoch,
        )

    def to_json(self) -> bytes:
        payload = {"v": RECORD_VERSION, **asdict(self)}
        data = json.dumps(payload, separators=(",", ":"), default=str).encode("utf-8")
        if len(data) > MAX_RECORD_BYTES:  # only ``extra`` can make it grow past the caps
            payload["extra"] = {}
            data = json.dumps(payload, separators=(",", ":"), default=str).encode("utf-8")
        return data

    @classmethod
    def from_json(cls, data: bytes | str) -> FailureRecord | None:
        """Parse a record read from the store; ``None`` (and a warning) for anything malformed."""
        if isinstance(data, str):
            data = data.encode("utf-8", "replace")
        if len(data) > MAX_RECORD_BYTES:
            log(logging.WARNING, "ignoring a failure record of %d bytes (limit %d)", len(data), MAX_RECORD_BYTES)
            return None
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            log(logging.WARNING, "ignoring a failure record that is not JSON: %s", err)
            return None
        problem = _schema_problem(obj)
        if problem:
            log(logging.WARNING, "ignoring a malformed failure record: %s", problem)
            return None
        return cls(
            rank=obj["rank"],
            exc_type=_cap_head(obj["exc_type"], MAX_NAME_CHARS),
            exc_message=_cap_head(obj["exc_message"], MAX_MESSAGE_CHARS),
            traceback=_cap_tail(obj["traceback"], MAX_TRACEBACK_CHARS),
            section=_cap_head(obj["section"], MAX_NAME_CHARS),
            seq=obj["seq"],
            time_ms=obj["time_ms"],
            pid=obj.get("pid", 0),
            host=_cap_head(obj.get("host", ""), MAX_NAME_CHARS),
            step=obj.get("step"),
            epoch=obj.get("epoch"),
            extra=obj.get("extra") or {},
        )


_REQUIRED = {
    "rank": int,
    "exc_type": str,
    "exc_message": str,
    "traceback": str,
    "section": str,
    "seq": int,
    "time_ms": int,
}
_OPTIONAL = {"pid": int, "host": str, "step": (int, type(None)), "epoch": (int, type(None)), "extra": (dict, type(None))}


def _schema_problem(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return f"expected an object, got {type(obj).__name__}"
    if obj.get("v") != RECORD_VERSION:
        return f"version {obj.get('v')!r}, expected {RECORD_VERSION}"
    for key, kind in _REQUIRED.items():
        value = obj.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"field {key!r} must be {kind.__name__}, got {type(value).__name__}"
    for key, kinds in _OPTIONAL.items():
        if key in obj and (not isinstance(obj[key], kinds) or isinstance(obj[key], bool)):
            return f"field {key!r} has type {type(obj[key]).__name__}"
    if obj["rank"] < 0:
        return "negative rank"
    return None
