"""The failure record: what one rank says about a failure, as bounded JSON in the c10d store.

The store is unauthenticated and shared by every process of the job, so a record is plain JSON with
a cap on every text field, written with :meth:`FailureRecord.to_json` and read back with
:meth:`FailureRecord.from_json`, which rejects (with a warning naming the store key) anything too
large, not JSON, of another version, of the wrong shape or out of range (a rank outside the world,
an absurd time or counter). Text read back is sanitised before it can reach a log: control
characters (terminal escapes), format characters and lone surrogates are replaced. Nothing read
from the store is ever unpickled or executed.

A record says where it came from in ``origin``:

* ``"failure"``: the rank ``rank`` failed itself (in section ``section``, at agreement ``seq`` when
  the failure went through one);
* ``"declared"``: rank ``by`` declares rank ``rank`` lost, silent or hung (``exc_type`` is the
  :class:`~.kinds.FailureKind`'s value: ``PeerLost``, ``PeerSilent``, ``RankHung``,
  ``RankSignalled``; a hung or signalled rank declares itself).

The record's :attr:`~FailureRecord.kind` and ``ended`` (how a lost rank's process ended, or the signal
a rank received: :class:`~.kinds.Ended`) are what code decides on; the message is for people. A
record without ``ended``, or with one out of range, is read with ``ended`` ``None``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import traceback
import unicodedata
from dataclasses import asdict, dataclass
from typing import Any

from .kinds import DECLARED_KINDS, Ended, FailureKind, is_int
from .log import log

#: Record format version; a reader ignores records of another version.
RECORD_VERSION = 2
#: Caps on the text fields of a record (characters). The traceback keeps its *tail*: the frames
#: nearest the raise are the ones that explain it.
MAX_MESSAGE_CHARS = 2_000
MAX_TRACEBACK_CHARS = 8_000
MAX_NAME_CHARS = 200
#: A record read back from the store larger than this (bytes) is ignored unread.
MAX_RECORD_BYTES = 16 * 1024
#: Largest step, epoch or agreement number a record may carry (a job never gets near it).
MAX_COUNTER = 2**53
MAX_PID = 2**31
#: A record whose time is further than this from the reader's clock (ms) is rejected.
MAX_CLOCK_DISTANCE_MS = 366 * 86400 * 1000

ORIGINS = ("failure", "declared")


def cap_head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"


def cap_tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "...[truncated]...\n" + text[-(limit - 19) :]


def sanitize(text: str) -> str:
    """Text from another process, safe to print: no terminal escapes, bidi tricks or surrogates."""
    if text.isascii() and text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in "\n\t":
            out.append(ch)
            continue
        category = unicodedata.category(ch)
        out.append("\ufffd" if category in ("Cc", "Cf", "Cs", "Co", "Cn") else ch)
    return "".join(out)


def exception_type_name(exc: BaseException) -> str:
    """``ValueError`` for builtins, ``package.module.Name`` otherwise."""
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def host_name() -> str:
    return cap_head(socket.gethostname(), MAX_NAME_CHARS)


@dataclass(frozen=True)
class FailureRecord:
    """One failure, as published in the store (see the module docstring for ``origin``)."""

    rank: int
    exc_type: str
    exc_message: str
    traceback: str
    section: str
    time_ms: int
    origin: str = "failure"
    seq: int | None = None
    pid: int = 0
    host: str = ""
    step: int | None = None
    epoch: int | None = None
    by: int | None = None
    ended: Ended | None = None

    @property
    def kind(self) -> FailureKind:
        return FailureKind.of(self.exc_type, self.origin)

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        *,
        rank: int,
        section: str,
        seq: int | None = None,
        step: int | None = None,
        epoch: int | None = None,
    ) -> FailureRecord:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            message = str(exc)
        except Exception as err:  # noqa: BLE001 - a broken __str__ must not replace the failure
            message = f"<str() of the exception failed: {type(err).__name__}>"
        return cls(
            rank=rank,
            exc_type=cap_head(exception_type_name(exc), MAX_NAME_CHARS),
            exc_message=cap_head(message, MAX_MESSAGE_CHARS),
            traceback=cap_tail(tb, MAX_TRACEBACK_CHARS),
            section=cap_head(section, MAX_NAME_CHARS),
            time_ms=int(time.time() * 1000),
            origin="failure",
            seq=seq,
            pid=os.getpid(),
            host=host_name(),
            step=step,
            epoch=epoch,
        )

    @classmethod
    def declared(
        cls, *, rank: int, kind: FailureKind, message: str, by: int, pid: int = 0, host: str = "", traceback: str = "",
        time_ms: int | None = None, step: int | None = None, ended: Ended | None = None,
    ) -> FailureRecord:
        """Rank ``by`` says rank ``rank`` is lost, silent or hung (``kind``)."""
        kind = FailureKind(kind)
        assert kind in DECLARED_KINDS, kind
        return cls(
            rank=rank,
            exc_type=kind.value,
            exc_message=cap_head(message, MAX_MESSAGE_CHARS),
            traceback=cap_tail(traceback, MAX_TRACEBACK_CHARS),
            section="",
            time_ms=int(time.time() * 1000) if time_ms is None else time_ms,
            origin="declared",
            pid=pid,
            host=cap_head(host, MAX_NAME_CHARS),
            step=step,
            by=by,
            ended=ended,
        )

    @classmethod
    def lost(cls, *, rank: int, pid: int, host: str, why: str | Ended, by: int) -> FailureRecord:
        """Rank ``by`` says rank ``rank`` (process ``pid`` on ``host``) is lost (``PeerLost``):
        ``rank 1 (pid 4242 on node-b) lost: killed by SIGKILL``. ``why``: how its process ended
        (carried by the record as ``ended``), or what was seen of a rank not seen to end."""
        ended = why if isinstance(why, Ended) else None
        how = why if ended is None else ended.describe()
        return cls.declared(rank=rank, kind=FailureKind.PEER_LOST, by=by, pid=pid, host=host, ended=ended,
                            message=f"rank {rank} (pid {pid} on {host}) lost: {how}")

    def to_json(self) -> bytes:
        return json.dumps({"v": RECORD_VERSION, **asdict(self)}, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str, *, world_size: int, key: str = "a record") -> FailureRecord | None:
        """Parse and check a record read from store key ``key``; ``None`` (and a warning naming
        the key) for anything malformed or out of range."""
        if isinstance(data, str):
            data = data.encode("utf-8", "replace")
        if len(data) > MAX_RECORD_BYTES:
            log(logging.WARNING, "ignoring store key %s: %d bytes, over the %d-byte limit of a failure record",
                key, len(data), MAX_RECORD_BYTES)
            return None
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            log(logging.WARNING, "ignoring store key %s: not a JSON failure record (%s)", key, sanitize(str(err))[:200])
            return None
        problem = schema_problem(obj, world_size)
        if problem:
            log(logging.WARNING, "ignoring store key %s: malformed failure record: %s", key, sanitize(problem)[:300])
            return None
        return cls(
            rank=obj["rank"],
            exc_type=sanitize(cap_head(obj["exc_type"], MAX_NAME_CHARS)),
            exc_message=sanitize(cap_head(obj["exc_message"], MAX_MESSAGE_CHARS)),
            traceback=sanitize(cap_tail(obj["traceback"], MAX_TRACEBACK_CHARS)),
            section=sanitize(cap_head(obj["section"], MAX_NAME_CHARS)),
            time_ms=obj["time_ms"],
            origin=obj["origin"],
            seq=obj.get("seq"),
            pid=obj.get("pid", 0),
            host=sanitize(cap_head(obj.get("host", ""), MAX_NAME_CHARS)),
            step=obj.get("step"),
            epoch=obj.get("epoch"),
            by=obj.get("by"),
            ended=Ended.from_json(obj.get("ended")),
        )


_REQUIRED: dict[str, type] = {
    "rank": int,
    "exc_type": str,
    "exc_message": str,
    "traceback": str,
    "section": str,
    "time_ms": int,
    "origin": str,
}
_OPTIONAL_INT = ("seq", "step", "epoch", "by")


def schema_problem(obj: Any, world_size: int) -> str | None:
    """Why ``obj`` is not a valid record for a job of ``world_size`` ranks (``None``: it is)."""
    if not isinstance(obj, dict):
        return f"expected an object, got {type(obj).__name__}"
    if obj.get("v") != RECORD_VERSION:
        return f"version {obj.get('v')!r}, expected {RECORD_VERSION}"
    for key, kind in _REQUIRED.items():
        value = obj.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"field {key!r} must be {kind.__name__}, got {type(value).__name__}"
    if not 0 <= obj["rank"] < world_size:
        return f"rank {obj['rank']} is outside [0, {world_size - 1}]"
    if obj["origin"] not in ORIGINS:
        return f"origin {obj['origin']!r} is not one of {', '.join(ORIGINS)}"
    now_ms = int(time.time() * 1000)
    if abs(obj["time_ms"] - now_ms) > MAX_CLOCK_DISTANCE_MS:
        return f"time_ms {obj['time_ms']} is more than a year from now"
    for key in _OPTIONAL_INT:
        value = obj.get(key)
        if value is None:
            continue
        if not is_int(value):
            return f"field {key!r} must be an int or null, got {type(value).__name__}"
        if not 0 <= value <= MAX_COUNTER:
            return f"field {key!r} = {value} is outside [0, {MAX_COUNTER}]"
    by = obj.get("by")
    if by is not None and not by < world_size:
        return f"by = {by} is outside [0, {world_size - 1}]"
    if obj["origin"] == "declared" and (by is None or obj["exc_type"] not in DECLARED_KINDS):
        return f"a declared record needs 'by' and a kind among {', '.join(DECLARED_KINDS)}"
    pid = obj.get("pid", 0)
    if not is_int(pid) or not 0 <= pid < MAX_PID:
        return f"field 'pid' must be an int in [0, {MAX_PID})"
    if not isinstance(obj.get("host", ""), str):
        return "field 'host' must be a str"
    return None
