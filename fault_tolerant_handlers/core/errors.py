"""Named errors raised when ranks fail together, and what counts as a backend's error."""

from __future__ import annotations

from typing import Any, Sequence

from . import compat_torch as _compat_torch
from .kinds import Ended, FailureKind
from .records import FailureRecord

#: Where a gloo error comes from: its text points into gloo's transport (``.../gloo/transport/tcp/
#: pair.cc:534] Connection closed by peer``) or into torch's gloo process group.
#: Exit code of a rank ended by the watchdog because another rank failed, was lost or hung.
EXIT_PEER_FAILED = 87
#: Exit code of the rank that declared itself hung.
EXIT_HUNG = 88

_GLOO_MARKERS = ("gloo/transport/", "ProcessGroupGloo.cpp")


def is_backend_error(exc: BaseException) -> bool:
    """True for what a collective or the store raises when a peer is gone or this rank was released.

    torch's ``DistError`` family (NCCL, the store, the network), and gloo's plain ``RuntimeError``
    whose text points into gloo's transport. A ``socket.timeout``, ``TimeoutError``,
    ``ConnectionResetError`` or any other error of user code is not one: it is the rank's own failure.
    """
    if isinstance(exc, _compat_torch.backend_error_types()):
        return True
    if type(exc) is RuntimeError:
        text = str(exc)
        return any(marker in text for marker in _GLOO_MARKERS)
    return False


def describe_where(section: str, step: int | None = None, epoch: int | None = None) -> str:
    """``'load data'`` or ``'train' (epoch 2, iteration 17)``."""
    parts = []
    if epoch is not None:
        parts.append(f"epoch {epoch}")
    if step is not None:
        parts.append(f"iteration {step}")
    where = repr(section)
    return f"{where} ({', '.join(parts)})" if parts else where


class PeerFailedError(RuntimeError):
    """Raised on every rank that did not fail, when another rank failed (or was lost or hung).

    The rank that failed re-raises its own exception unchanged; every other rank raises this error,
    which carries what the failing rank (or the rank that saw it die) reported through the store.

    Attributes:
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

    def __init__(
        self,
        failed_rank: int | None,
        exc_type: str,
        exc_message: str,
        remote_traceback: str = "",
        where: str = "",
        *,
        section: str = "",
        step: int | None = None,
        epoch: int | None = None,
        failed_at: float | None = None,
        pid: int | None = None,
        host: str = "",
        origin: str = "failure",
        others: Sequence[dict[str, Any]] = (),
        kind: FailureKind | None = None,
        ended: Ended | None = None,
    ) -> None:
        self.failed_rank = failed_rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.where = where
        self.section = section
        self.step = step
        self.epoch = epoch
        self.failed_at = failed_at
        self.pid = pid
        self.host = host
        self.origin = origin
        self.others = [dict(o) for o in others]
        self.kind = FailureKind.of(exc_type, origin) if kind is None else FailureKind(kind)
        self.ended = ended
        super().__init__(self._format())

    @classmethod
    def from_records(cls, records: Sequence[FailureRecord], fallback_rank: int | None = None,
                     section: str = "") -> PeerFailedError:
        """The error for the records of one failure episode; the earliest failure is the cause."""
        if not records:
            return cls(fallback_rank, FailureKind.UNKNOWN.value, "the failing rank's record could not be read from "
                       "the store", where=repr(section), section=section, kind=FailureKind.UNKNOWN)
        # One record per rank: what it said itself (its failure, or a signal it received) over what
        # a peer declared about it, then the earliest (a rank that raised and was also declared
        # silent by a watchdog is named once, by its own error; SIGINT's RankSignalled comes before
        # the KeyboardInterrupt it turns into).
        def rank_of(r: FailureRecord) -> tuple[bool, int]:
            return (r.origin != "failure" and r.by != r.rank, r.time_ms)

        best: dict[int, FailureRecord] = {}
        for r in records:
            kept = best.get(r.rank)
            if kept is None or rank_of(r) < rank_of(kept):
                best[r.rank] = r
        ordered = sorted(best.values(), key=lambda r: (r.time_ms, r.rank))
        first = ordered[0]
        others = [{"rank": r.rank, "exc_type": r.exc_type, "exc_message": r.exc_message} for r in ordered[1:]]
        return cls(
            first.rank,
            first.exc_type,
            first.exc_message,
            first.traceback,
            describe_where(first.section, first.step, first.epoch) if first.origin == "failure" else "",
            section=first.section,
            step=first.step,
            epoch=first.epoch,
            failed_at=first.time_ms / 1000.0,
            pid=first.pid or None,
            host=first.host,
            origin=first.origin,
            others=others,
            kind=first.kind,
            ended=first.ended,
        )

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
        return (
            _rebuild,
            (
                self.failed_rank,
                self.exc_type,
                self.exc_message,
                self.remote_traceback,
                self.where,
                {
                    "section": self.section,
                    "step": self.step,
                    "epoch": self.epoch,
                    "failed_at": self.failed_at,
                    "pid": self.pid,
                    "host": self.host,
                    "origin": self.origin,
                    "others": self.others,
                    "kind": self.kind,
                    "ended": self.ended,
                },
            ),
        )


def _rebuild(failed_rank, exc_type, exc_message, remote_traceback, where, kwargs):
    return PeerFailedError(failed_rank, exc_type, exc_message, remote_traceback, where, **kwargs)


class SectionMismatchError(RuntimeError):
    """The ranks met in different fail-together sections (or at different agreements): a bug in
    the job, like a collective called on some ranks only. Raised on every rank of the agreement.

    Attributes:
        sections: ``{rank: "fail_together 'x' (agreement 3)", ...}`` for the ranks that could say.
    """

    def __init__(self, message: str, sections: dict[int, str] | None = None) -> None:
        self.sections = dict(sections or {})
        super().__init__(message)

    def __reduce__(self):
        return (SectionMismatchError, (str(self), self.sections))


# Their public path (:mod:`fault_tolerant_handlers.errors`): what tracebacks, records and pickles name.
PeerFailedError.__module__ = SectionMismatchError.__module__ = "fault_tolerant_handlers.errors"
FailureKind.__module__ = Ended.__module__ = "fault_tolerant_handlers.errors"


class HangInterrupted(BaseException):
    """Raised in a hung rank's main thread, where it hangs, when the job recovers in place
    (:func:`fault_tolerant_handlers.recover_in_place` with ``hang_timeout`` set): the rank's own
    failure, whose message is what its watchdog found (no progress for ``hang_timeout``).

    A ``BaseException``, like ``KeyboardInterrupt``: an ``except Exception:`` lets it through. Code
    that catches it anyway and carries on meets it again at the library's next hook, until the
    recovery takes it. It waits outside :class:`~fault_tolerant_handlers.deferred_interrupt`
    sections (:mod:`.interrupts`). (Before: a ``RuntimeError``.)
    """


class StateTransferError(RuntimeError):
    """A transfer of live state over the re-formed group (:func:`..recover.live_state.transfer`)
    failed: a chunk that arrived with another CRC than the source's, a header that could not be
    read, a received state without the agreed checksum, or a source that could not send. Raised on
    every rank of the group together (one small ``all_gather`` after the last chunk), so that every
    rank falls back to the newest checkpoint together. A receiver's state is then not to be trusted
    (what arrived before the bad chunk, and a bad slice itself, was already written into it).

    Attributes:
        source: the group rank that sent.
        failures: ``{group rank: (kind, chunk)}`` for every rank that failed; ``kind`` is a
            :class:`~..recover.live_state.TransferFailure` value, ``chunk`` the 0-based chunk
            (-1: not a chunk's fault).
    """

    def __init__(self, message: str, source: int | None = None,
                 failures: dict[int, tuple[str, int]] | None = None) -> None:
        self.source = source
        self.failures = dict(failures or {})
        super().__init__(message)

    def __reduce__(self):
        return (StateTransferError, (str(self), self.source, self.failures))


class RecoveryError(RuntimeError):
    """Recovering in place could not go on: the training function cannot be called twice in one
    process (a later attempt failed before its process group was formed), the failed attempt could
    not be torn down, or ``recover_in_place`` wraps the launcher that spawns the ranks rather than the
    function each rank runs (raised in the ranks at start, and in the launching process). The
    exception of the attempt, if any, is its ``__cause__``; the job ends as it would have without
    recovery in place (a relaunch resumes it)."""
