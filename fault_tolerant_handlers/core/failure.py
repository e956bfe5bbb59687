"""The one failure value, from the moment a failure is recorded to the moment every rank raises (and a
recovery in place is told of it): a :class:`FailureRecord`, decided on by its ``kind`` and ``ended``,
never by message text. The store is unauthenticated: records are plain JSON of the one codec
(:func:`encode`, :func:`decode`), bounded, range-checked and sanitised, never unpickled. The attempt's
:class:`FailureState` answers "has this job failed?"; a :class:`Tag` is what the library learned of
one exception object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal as _signal
import socket
import threading
import time
import traceback
import typing
import unicodedata
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar, Sequence

from .hooks import first_line, log

#: In a field's bounds (:func:`decode`): the upper bound of a rank of the reader's world (below its size).
WORLD = "world"


# -- kinds as data -----------------------------------------------------------------------------------
_SIGNAL_NAMES = {int(s): s.name for s in _signal.Signals}
#: Largest signal number and exit code an :class:`Ended` read back from the store may carry.
MAX_SIGNAL = 64
MAX_EXIT_CODE = 255


class FailureKind(str, Enum):
    """The kind of a failure; its value is a declared record's ``exc_type``, as records and messages show it."""

    #: A rank raised an exception (``exc_type`` names its type).
    RAISED = "raised"
    #: Declared by a peer: the rank's process ended (``ended`` says how), or its host, or the
    #: store it held, is gone (``ended`` is ``None``).
    PEER_LOST = "PeerLost"
    #: Declared by a peer: the rank's heartbeat stopped (its host or link is down, or it is frozen).
    PEER_SILENT = "PeerSilent"
    #: Seen by a rank: the c10d store stopped answering, and no rank runs on its host (a store on a
    #: host of its own): no rank is to blame. Never published (the store is what is gone).
    STORE_LOST = "StoreLost"
    #: Declared by the rank itself: its main thread made no progress for ``hang_timeout``.
    RANK_HUNG = "RankHung"
    #: Declared by the rank itself: it received a signal that ends the job (``ended.signal``).
    RANK_SIGNALLED = "RankSignalled"
    #: A collective broke and no rank said why.
    COMMUNICATION = "CommunicationError"
    #: No rank's record of the failure could be read.
    UNKNOWN = "unknown"
    #: Recovering in place: the process of a rank that died was replaced by its keeper.
    RANK_REPLACED = "RankReplaced"

    __str__ = str.__str__  # the value, in messages and f-strings, on every Python version
    __format__ = str.__format__

    @classmethod
    def of(cls, exc_type: str, origin: str) -> FailureKind:
        """The kind of a record of ``origin`` whose ``exc_type`` is ``exc_type`` (a declared one's is its kind)."""
        if origin == "declared" or exc_type == cls.UNKNOWN.value:
            with contextlib.suppress(ValueError):
                return cls(exc_type)
        return cls.RAISED


#: The kinds a rank (the record's ``by``) declares; ``StoreLost`` and ``CommunicationError`` blame no rank.
DECLARED_KINDS = (FailureKind.PEER_LOST, FailureKind.PEER_SILENT, FailureKind.RANK_HUNG, FailureKind.RANK_SIGNALLED,
                  FailureKind.RANK_REPLACED)
#: The kinds whose record may name no rank (``rank`` ``None``).
BLAMELESS = (FailureKind.UNKNOWN, FailureKind.STORE_LOST, FailureKind.COMMUNICATION)


@dataclass(frozen=True)
class Ended:
    """How a rank's process ended (``PeerLost``: ``exit_code`` or the ``signal`` that killed it;
    neither: its exit status was not visible), or the signal a rank received (``RankSignalled``).
    ``keeper_gone``: the process that would have replaced it in place was gone too."""

    exit_code: int | None = None
    signal: int | None = None
    keeper_gone: bool = False

    @classmethod
    def from_status(cls, status: int) -> Ended:
        """From a wait status (``os.waitpid``'s, or the exit code field of ``/proc/<pid>/stat``)."""
        if status & 0x7F:
            return cls(signal=status & 0x7F)
        return cls(exit_code=(status >> 8) & 0xFF)

    @property
    def killed(self) -> bool:
        return self.signal is not None

    @property
    def unseen(self) -> bool:
        return self.exit_code is None and self.signal is None

    @property
    def signal_name(self) -> str | None:
        """``"SIGKILL"`` (``"signal 42"`` for a number without a name), or ``None``."""
        if self.signal is None:
            return None
        return _SIGNAL_NAMES.get(self.signal, f"signal {self.signal}")

    def describe(self) -> str:
        if self.signal is not None:
            how = f"killed by {self.signal_name}"
        elif self.exit_code is not None:
            how = f"exited with code {self.exit_code}"
        else:
            how = "process is gone (exit status not visible from this process)"
        return f"{how}, and its keeper is gone too" if self.keeper_gone else how

    BOUNDS: ClassVar[dict] = {"exit_code": (0, MAX_EXIT_CODE), "signal": (1, MAX_SIGNAL)}

    def problem(self, world: int) -> str | None:
        return "both an exit code and a signal" if self.exit_code is not None and self.signal is not None else None


class Stored:
    """A frozen dataclass the store holds, read back within its fields' ``BOUNDS`` (:func:`decode`)."""

    #: Larger than this (bytes), it is ignored unread.
    MAX_BYTES: ClassVar[int] = 8 * 1024
    BOUNDS: ClassVar[dict] = {}

    def to_json(self) -> bytes:
        return encode(self)

    @classmethod
    def from_json(cls, raw: Any, world_size: int, *, key: str | None = None) -> Any:
        return decode(cls, raw, world=world_size, max_bytes=cls.MAX_BYTES, key=key)


# -- the record and its codec ------------------------------------------------------------------------
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
#: What :meth:`FailureRecord.to_json` keeps at least of a traceback it fits.
_KEPT_CHARS = 200


def cap_head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"


def cap_tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "...[truncated]...\n" + text[-(limit - 19) :]


def sanitize(text: str) -> str:
    """Text from another process, safe to print: no terminal escapes, bidi tricks or surrogates."""
    if text.isascii() and text.isprintable():
        return text
    return "".join("\ufffd" if ch not in "\n\t" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn") else ch
                   for ch in text)


def host_name() -> str:
    return cap_head(socket.gethostname(), MAX_NAME_CHARS)


@dataclass(frozen=True)
class FailureRecord(Stored):
    """One failure: published in the store, carried by :class:`PeerFailedError` (``err.record``), and told
    in a recovery in place (the public ``RecoveryCause``, :attr:`RecoveryInfo.cause`).

    ``origin``: ``"failure"`` (the rank reported its own) or ``"declared"`` (rank ``by`` declared it
    lost, silent, hung, ...). ``message`` and ``where`` read ``exc_message`` and ``section``. Set only
    where a rank tells it in a recovery's agreement: ``own`` (that rank failed itself) and
    ``not_in_place`` (why it cannot be recovered in place; ``""``: it can).
    """

    rank: int | None
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
    own: bool = False
    not_in_place: str = ""

    @property
    def kind(self) -> FailureKind:
        return FailureKind.of(self.exc_type, self.origin)

    message = property(lambda self: self.exc_message)
    where = property(lambda self: self.section)

    def describe(self) -> str:
        """``rank 1 failed in train: ValueError: bad sample 42`` (the type without its module)."""
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        where = f" in {self.section}" if self.section else ""
        first = first_line(self.exc_message, None)
        return f"{who} failed{where}: {self.exc_type.rsplit('.', 1)[-1]}" + (f": {first}" if first else "")

    @classmethod
    def from_exception(cls, exc: BaseException, *, rank: int, section: str, seq: int | None = None,
                       step: int | None = None, epoch: int | None = None) -> FailureRecord:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        t = type(exc)  # ValueError for builtins, package.module.Name otherwise
        name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        try:
            message = str(exc)
        except Exception as err:  # noqa: BLE001 - a broken __str__ must not replace the failure
            message = f"<str() of the exception failed: {type(err).__name__}>"
        return cls(rank, cap_head(name, MAX_NAME_CHARS), cap_head(message, MAX_MESSAGE_CHARS),
                   cap_tail(tb, MAX_TRACEBACK_CHARS), cap_head(section, MAX_NAME_CHARS), int(time.time() * 1000),
                   seq=seq, pid=os.getpid(), host=host_name(), step=step, epoch=epoch)

    @classmethod
    def declared(
        cls, *, rank: int, kind: FailureKind, message: str, by: int, pid: int = 0, host: str = "", traceback: str = "",
        time_ms: int | None = None, step: int | None = None, ended: Ended | None = None,
    ) -> FailureRecord:
        """Rank ``by`` declares rank ``rank``'s failure of ``kind`` (lost, silent, hung, ...)."""
        kind = FailureKind(kind)
        assert kind in DECLARED_KINDS, kind
        return cls(rank, kind.value, cap_head(message, MAX_MESSAGE_CHARS), cap_tail(traceback, MAX_TRACEBACK_CHARS),
                   "", int(time.time() * 1000) if time_ms is None else time_ms, "declared", pid=pid,
                   host=cap_head(host, MAX_NAME_CHARS), step=step, by=by, ended=ended)

    @classmethod
    def lost(cls, *, rank: int, pid: int, host: str, why: str | Ended, by: int) -> FailureRecord:
        """Rank ``by`` says rank ``rank`` (process ``pid`` on ``host``) is lost (``PeerLost``); ``why``:
        how its process ended (the record's ``ended``), or what was seen of a rank not seen to end."""
        ended = why if isinstance(why, Ended) else None
        how = why if ended is None else ended.describe()
        return cls.declared(rank=rank, kind=FailureKind.PEER_LOST, by=by, pid=pid, host=host, ended=ended,
                            message=f"rank {rank} (pid {pid} on {host}) lost: {how}")

    @classmethod
    def replaced(cls, rank: int, message: str) -> FailureRecord:
        """What a replacement of rank ``rank`` (a keeper's new child, a spare) tells its peers' recovery."""
        return dataclasses.replace(cls.declared(rank=rank, kind=FailureKind.RANK_REPLACED, message=message, by=rank),
                                   own=True)

    VERSION: ClassVar[int] = 2  # a reader ignores records of another version
    MAX_BYTES: ClassVar[int] = MAX_RECORD_BYTES
    BOUNDS: ClassVar[dict] = {
        "rank": (0, WORLD), "exc_type": MAX_NAME_CHARS, "exc_message": MAX_MESSAGE_CHARS,
        "traceback": -MAX_TRACEBACK_CHARS, "section": MAX_NAME_CHARS, "time_ms": (0, 2**62), "seq": (0, MAX_COUNTER),
        "pid": (0, MAX_PID - 1), "host": MAX_NAME_CHARS, "step": (0, MAX_COUNTER), "epoch": (0, MAX_COUNTER),
        "by": (0, WORLD), "origin": 20, "not_in_place": 300}

    def to_json(self) -> bytes:
        """Encoded within :data:`MAX_RECORD_BYTES`, which a reader enforces: text far outside ASCII (up
        to 4 bytes a character) gives up the traceback's oldest part (every other field is bounded to
        at most 13 KB together)."""
        record, raw = self, encode(self)
        while len(raw) > MAX_RECORD_BYTES and len(record.traceback) > _KEPT_CHARS:
            cut = len(raw) - MAX_RECORD_BYTES + 32  # >= 1 byte a character, and room for the marker
            record = dataclasses.replace(record, traceback=cap_tail(record.traceback,
                                                                    max(_KEPT_CHARS, len(record.traceback) - cut)))
            raw = encode(record)
        return raw

    def problem(self, world: int) -> str | None:
        """What the field bounds cannot say."""
        if self.origin not in ORIGINS:
            return f"origin {self.origin!r} is not one of {', '.join(ORIGINS)}"
        if self.rank is None and self.kind not in BLAMELESS:
            return "field 'rank' must be an int"
        if abs(self.time_ms - time.time() * 1000) > MAX_CLOCK_DISTANCE_MS:
            return f"time_ms {self.time_ms} is more than a year from now"
        if self.origin == "declared" and (self.kind is FailureKind.RAISED or
                                          (self.by is None and self.kind in DECLARED_KINDS)):
            return f"a declared record needs a kind, and 'by' for {', '.join(DECLARED_KINDS)}"
        return None


# -- one bounded JSON codec for every frozen record of the store -------------------------------------
_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool}


def encode(record: Any) -> bytes:
    """A frozen dataclass as compact JSON (with its ``VERSION`` when it has one): what :func:`decode` reads."""
    version = getattr(record, "VERSION", None)
    # UTF-8, not escapes: text outside ASCII costs 2-4 bytes a character, not 6-12 (a lone
    # surrogate, which UTF-8 cannot hold, becomes "?")
    return json.dumps({**({} if version is None else {"v": version}), **asdict(record)},
                      separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")


def decode(cls: type, raw: Any, *, world: int, max_bytes: int, key: str | None = None) -> Any:
    """A ``cls`` (a frozen dataclass) read back from the store, which is unauthenticated: never
    unpickled, every value bounded and range-checked. ``None`` (with a warning naming ``key``, when
    given) for anything larger than ``max_bytes``, not JSON, of another ``VERSION``, or with a
    field of the wrong type or outside ``cls.BOUNDS``:

    * an ``int`` or ``float`` field: ``(low, high)``, inclusive; ``high`` :data:`WORLD`: a rank of a
      world of ``world`` ranks; a ``tuple[int, ...]`` field: ``(low, high, most items)``;
    * a ``str`` field: its most characters (negative: the tail is kept), or ``("hex", chars)`` for a
      lower-case hex digest ("" otherwise); text is sanitised (:func:`sanitize`);
    * a field of a dataclass type is read the same way (``None``, where allowed, when it is malformed);
    * ``cls.problem(record, world)``, when defined, says what the bounds cannot.

    A field missing from the JSON takes its default; one without a default must be there."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "replace")
    if not isinstance(raw, (bytes, bytearray)):
        problem = f"not bytes but {type(raw).__name__}"
    elif len(raw) > max_bytes:
        problem = f"{len(raw)} bytes, over the {max_bytes}-byte limit"
    else:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            problem = f"not JSON ({sanitize(str(err))[:200]})"
        else:
            record, problem = _from_obj(cls, obj, world)
            if problem is None:
                return record
    if key is not None:
        log(logging.WARNING, "ignoring store key %s: not a valid %s: %s", key, cls.__name__, sanitize(problem)[:300])
    return None


def _from_obj(cls: type, obj: Any, world: int, nested: bool = False) -> tuple[Any, str | None]:
    if not isinstance(obj, dict):
        return None, f"expected an object, got {type(obj).__name__}"
    version = getattr(cls, "VERSION", None)
    if version is not None and not nested and obj.get("v") != version:
        return None, f"version {obj.get('v')!r}, expected {version}"
    hints, bounds, values = typing.get_type_hints(cls, localns=globals()), getattr(cls, "BOUNDS", {}), {}
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            if f.default is dataclasses.MISSING:
                return None, f"field {f.name!r} is missing"
            continue
        value, problem = _field(f.name, hints[f.name], bounds.get(f.name), obj[f.name], world)
        if problem is not None:
            return None, problem
        values[f.name] = value
    record = cls(**values)
    check = getattr(cls, "problem", None)
    problem = check(record, world) if check is not None else None
    return (None, problem) if problem else (record, None)


def _field(name: str, hint: Any, bound: Any, value: Any, world: int) -> tuple[Any, str | None]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    if value is None:
        return (None, None) if optional else (None, f"field {name!r} must not be null")
    kind = args[0] if optional and len(args) == 1 else hint
    if dataclasses.is_dataclass(kind):
        nested, problem = _from_obj(kind, value, world, nested=True)
        return (nested, None) if problem is None or optional else (None, f"field {name!r}: {problem}")
    if typing.get_origin(kind) is tuple:
        if not isinstance(value, list) or len(value) > bound[2] or not all(type(v) is int for v in value):
            return None, f"field {name!r} must be a list of at most {bound[2]} ints"
        if not all(bound[0] <= v <= (world - 1 if bound[1] == WORLD else bound[1]) for v in value):
            return None, f"field {name!r} holds a value outside its bounds"
        return tuple(value), None
    expected = _TYPES[kind.__name__ if isinstance(kind, type) else str(kind)]
    if not isinstance(value, expected) or (kind is not bool and isinstance(value, bool)):
        return None, f"field {name!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}"
    if kind is str:
        if isinstance(bound, tuple):  # ("hex", chars)
            return (value if len(value) <= bound[1] and all(c in "0123456789abcdef" for c in value) else ""), None
        return sanitize(cap_tail(value, -bound) if bound < 0 else cap_head(value, bound)), None
    if bound is not None:
        low, high = bound[0], (world - 1 if bound[1] == WORLD else bound[1])
        if not low <= value <= high:
            return None, f"field {name!r} = {value} is outside [{low}, {high}]"
    return value, None


# -- the error every other rank raises ---------------------------------------------------------------
def describe_where(section: str, step: int | None = None, epoch: int | None = None) -> str:
    """``'load data'`` or ``'train' (epoch 2, iteration 17)``."""
    parts = [f"{name} {n}" for name, n in (("epoch", epoch), ("iteration", step)) if n is not None]
    return f"{section!r} ({', '.join(parts)})" if parts else repr(section)


class PeerFailedError(RuntimeError):
    """Raised on every rank that did not fail, when another rank failed (or was lost or hung).

    The rank that failed re-raises its own exception unchanged; every other rank raises this error,
    which carries what the failing rank (or the rank that saw it die) reported through the store.

    Attributes:
        record: the failure, as the one :class:`FailureRecord` the rest are read from.
        failed_rank: global rank that failed first (earliest timestamp; lowest rank on a tie).
            ``None`` only when no rank could say who failed.
        exc_type: the failing rank's exception type (``"ValueError"``), or for a rank that was lost,
            silent or hung the kind: ``"PeerLost"``, ``"PeerSilent"``, ``"RankHung"``.
        kind: the :class:`FailureKind` (``FailureKind.RAISED`` for an exception a rank raised,
            ``FailureKind.PEER_LOST``, ...): what code compares, rather than ``exc_type`` or the message.
        ended: how a lost rank's process ended (:class:`Ended`: its exit code or the signal that
            killed it), or the signal a signalled rank received; ``None`` when not known (a rank
            whose host or store is gone, an exception).
        exc_message: ``str()`` of that exception (capped), or what was seen of the lost rank.
        remote_traceback: the failing rank's formatted traceback, or a hung rank's main-thread stack.
        where: the section name, with epoch and iteration when an adapter knows them.
        section, step, epoch: the parts of ``where``.
        failed_at: wall-clock time of the failure (seconds since the epoch).
        pid, host: the failing process.
        origin: ``"failure"`` (the rank reported its own failure) or ``"declared"`` (another rank,
            or the watchdog of a hung rank, declared it lost, silent or hung).
        others: the other ranks that failed in the same episode, as
            ``[{"rank": 3, "exc_type": "KeyError", "exc_message": "'x'"}, ...]``.
    """

    def __init__(self, failed_rank: int | None = None, exc_type: str = "", exc_message: str = "",
                 remote_traceback: str = "", where: str = "", *, section: str = "", step: int | None = None,
                 epoch: int | None = None, failed_at: float | None = None, pid: int | None = None, host: str = "",
                 origin: str = "failure", others: Sequence[dict[str, Any]] = (), kind: FailureKind | None = None,
                 ended: Ended | None = None, record: FailureRecord | None = None) -> None:
        if record is None:
            record = FailureRecord(failed_rank, exc_type, exc_message, remote_traceback, section,
                                   0 if failed_at is None else round(failed_at * 1000), origin, pid=pid or 0,
                                   host=host, step=step, epoch=epoch, ended=ended)
        self.record = record
        self.where = where
        self.others = [dict(o) for o in others]
        self.kind = record.kind if kind is None else FailureKind(kind)
        super().__init__(self._format())

    failed_rank = property(lambda self: self.record.rank)
    exc_type = property(lambda self: self.record.exc_type)
    exc_message = property(lambda self: self.record.exc_message)
    remote_traceback = property(lambda self: self.record.traceback)
    section = property(lambda self: self.record.section)
    step = property(lambda self: self.record.step)
    epoch = property(lambda self: self.record.epoch)
    failed_at = property(lambda self: self.record.time_ms / 1000.0 if self.record.time_ms else None)
    pid = property(lambda self: self.record.pid or None)
    host = property(lambda self: self.record.host)
    origin = property(lambda self: self.record.origin)
    ended = property(lambda self: self.record.ended)

    @classmethod
    def from_records(cls, records: Sequence[FailureRecord], fallback_rank: int | None = None,
                     section: str = "") -> PeerFailedError:
        """The error for the records of one failure episode; the earliest failure is the cause."""
        if not records:
            return cls(fallback_rank, FailureKind.UNKNOWN.value, "the failing rank's record could not be read from "
                       "the store", where=repr(section), section=section)
        # one record per rank: what it said itself over what a peer declared about it, then the earliest
        best: dict[int, FailureRecord] = {}
        for r in sorted(records, key=lambda r: (r.origin != "failure" and r.by != r.rank, r.time_ms)):
            best.setdefault(r.rank, r)
        first, *rest = sorted(best.values(), key=lambda r: (r.time_ms, r.rank))
        return cls(record=first, others=[{"rank": r.rank, "exc_type": r.exc_type, "exc_message": r.exc_message}
                                         for r in rest],
                   where=describe_where(first.section, first.step, first.epoch) if first.origin == "failure" else "")

    def _format(self) -> str:
        who = "an unknown rank" if self.failed_rank is None else f"rank {self.failed_rank}"
        if self.origin == "declared":  # the message already says who and what
            text = f"{self.exc_type}: {self.exc_message}"
        else:
            text = f"{who} failed in {self.where or 'a fail-together section'}: {self.exc_type}: {self.exc_message}"
        if self.others:
            also = "; ".join(f"rank {o['rank']}: {o['exc_type']}: {o['exc_message']}" for o in self.others)
            text += f"\nalso failed: {also}"
        if self.remote_traceback:
            origin = f" (pid {self.pid} on {self.host})" if self.pid and self.host else ""
            text += f"\n\nTraceback of {who}{origin}:\n{self.remote_traceback.rstrip()}"
        return text

    def __reduce__(self):  # picklable for launchers that ship exceptions between processes
        return (_rebuild, (self.record, self.where, self.others, self.kind))


def _rebuild(record, where, others, kind):
    return PeerFailedError(record=record, where=where, others=others, kind=kind)


# Their public path (:mod:`fault_tolerant_handlers.errors`): what tracebacks, records and pickles name.
PeerFailedError.__module__ = FailureKind.__module__ = Ended.__module__ = "fault_tolerant_handlers.errors"


# -- the failure state of an attempt -----------------------------------------------------------------
@dataclass
class Incident:
    """What this process knows of the failure under way since the last agreement (its :class:`FailureState`
    writes it): a peer's error, whether this rank failed itself, whether the main thread took it."""

    peer_error: PeerFailedError | None = None
    local: bool = False
    acknowledged: threading.Event = field(default_factory=threading.Event)


class FailureState:
    """The failure state of one attempt on one process group: transitions take a lock, queries do not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cause: FailureRecord | None = None
        self._incident = Incident()
        self._escalated: list[Incident] = []  # incidents escalated, not yet acknowledged
        self._delivered = False
        self._signal: PeerFailedError | None = None
        self._moves = 0

    # -- queries (attribute reads, no lock) ------------------------------------------------------------
    #: The attempt's first failure (this rank's own, a peer's, its own signal); ``None``: none.
    cause = property(lambda self: self._cause)
    #: How often the cause was set or the main thread took a failure (the hang check waits for a beat after).
    moves = property(lambda self: self._moves)
    #: A failure reached this rank's main thread: its own (published), a failed agreement, its own signal.
    delivered = property(lambda self: self._delivered)
    #: **Has this job failed?** A failure was delivered, or the watchdog knows a peer's.
    failing = property(lambda self: self._delivered or self._incident.peer_error is not None)
    #: A peer's failure the watchdog found in the current incident (no communication).
    peer_error = property(lambda self: self._incident.peer_error)
    #: This rank failed itself in the current incident.
    local = property(lambda self: self._incident.local)
    #: This rank's own SIGTERM/SIGINT, when it is the job's cause (a collective broken after it is no peer's).
    signal = property(lambda self: self._signal)

    # -- transitions ----------------------------------------------------------------------------------
    def failed_here(self, record: FailureRecord, *, told: bool = True) -> None:
        """This rank failed itself (``record``); ``told=False``: a hang the watchdog found, not raised."""
        with self._lock:
            self._incident.local = True
            self._delivered = self._delivered or told
            self._set_cause(record)

    def peer_failed(self, err: PeerFailedError) -> Incident | None:
        """The watchdog found a peer's failure: the incident to escalate, or ``None`` (already known,
        this rank's own signal is the cause, or this rank failed itself)."""
        with self._lock:
            incident = self._incident
            if incident.peer_error is not None or self._signal is not None:
                return None
            incident.peer_error = err
            self._set_cause(err.record)
            if incident.local:
                return None
            self._escalated.append(incident)
            return incident

    def signalled(self, cause: PeerFailedError) -> bool:
        """This rank's own SIGTERM/SIGINT (``cause``: its ``RankSignalled``); whether it was the first."""
        with self._lock:
            if self._signal is not None:
                return False
            self._signal = cause
            self._incident.local = True  # the peers' reaction is not a failure to escalate here
            self._delivered = True  # the job fails: its exit does not wait on a store that may be leaving
            self._set_cause(cause.record)
            return True

    def acknowledged(self, err: BaseException | None = None) -> None:
        """The main thread takes a peer's failure (``err``) and raises it: the incident its tag names
        (else the current one) and every escalated one are acknowledged."""
        taken = tag_of(err).incident if err is not None else None
        with self._lock:
            self._moves += 1
            for incident in (taken or self._incident, *self._escalated):
                incident.acknowledged.set()
            self._escalated.clear()
            if isinstance(err, PeerFailedError):
                self._set_cause(err.record)

    def _set_cause(self, failure: FailureRecord) -> None:
        """Under the lock: the first failure is the cause."""
        if self._cause is None:
            self._cause = failure
            self._moves += 1

    def agreement_ended(self, failed: bool, error: BaseException | None = None) -> Incident:
        """An agreement ended (``error``: what this rank raises); a fresh incident begins; returns the ended one."""
        with self._lock:
            ended = self._incident
            self._delivered = self._delivered or failed
            if failed and isinstance(error, PeerFailedError):
                self._set_cause(error.record)
            self._incident = Incident()
            return ended


# -- the tag ----------------------------------------------------------------------------------------
#: The one attribute the library sets on an exception object.
TAG_ATTR = "_fth_failure"


@dataclass(frozen=True)
class Tag:
    """What the library learned of one exception object: the ``record`` this rank published for it, the
    ``incident`` an agreement delivered it in, whether it came out of an agreement (an enclosing section
    lets it through), an adapter ``handled`` it or ``taken`` its framework's exception path, ``raised_as``."""

    record: FailureRecord | None = None
    incident: Incident | None = None
    agreed: bool = False
    handled: bool = False
    taken: bool = False
    raised_as: BaseException | None = None


_UNTAGGED = Tag()


def tag_of(exc: BaseException | None) -> Tag:
    """The tag of ``exc`` (an empty one when it has none)."""
    found = getattr(exc, TAG_ATTR, None) if exc is not None else None
    return found if isinstance(found, Tag) else _UNTAGGED


def tag(exc: BaseException, **learned: object) -> None:
    """Add what was ``learned`` (:class:`Tag`'s fields) to the tag of ``exc``, where its type allows."""
    new = dataclasses.replace(tag_of(exc), **learned)  # a field that does not exist raises here
    with contextlib.suppress(Exception):  # some exception types refuse attributes
        setattr(exc, TAG_ATTR, new)
