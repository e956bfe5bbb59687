"""Named errors raised when ranks fail together."""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from .record import FailureRecord


#: Substrings of the messages torch.distributed backends raise when a peer or the store is gone.
_COMM_MARKERS = (
    "gloo",
    "Connection closed",
    "Connection reset",
    "NCCL",
    "ProcessGroup",
    "Timed out",
    "timed out",
    "Broken pipe",
    "recvValue",
    "Socket",
)


def is_communication_error(exc: BaseException) -> bool:
    """True for the errors a collective or the store raises when a peer is gone or released."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, (RuntimeError, ConnectionError, OSError)):
        text = str(exc)
        return any(marker in text for marker in _COMM_MARKERS)
    return False


#: The ``section`` of records the watchdog publishes for a lost, silent or hung rank.
WATCHDOG_SECTION = "the watchdog"


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
    """Raised on every rank that did not fail, when another rank failed at a sync point.

    The rank that failed re-raises its own exception unchanged; every other rank raises this error,
    which carries what the failing rank reported through the store.

    Attributes:
        failed_rank: global rank that failed first (earliest timestamp; lowest rank on a tie).
            ``None`` only when no rank could say who failed.
        exc_type: the failing rank's exception type, e.g. ``"ValueError"``.
        exc_message: ``str()`` of that exception (capped).
        remote_traceback: the failing rank's formatted traceback (capped, tail kept).
        where: the section name, with epoch and iteration when an adapter knows them.
        section, step, epoch: the parts of ``where``.
        failed_at: wall-clock time of the failure on the failing rank (seconds since the epoch).
        others: the other ranks that failed in the same section, as
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
        others: Sequence[dict[str, Any]] = (),
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
        self.others = [dict(o) for o in others]
        super().__init__(self._format())

    @classmethod
    def from_records(cls, records: Sequence[FailureRecord], fallback_rank: int | None = None, section: str = "") -> PeerFailedError:
        """Build the error from the records of one agreement; the earliest failure is the cause."""
        if not records:
            return cls(
                fallback_rank,
                "unknown",
                "the failing rank's record could not be read from the store",
                where=repr(section),
                section=section,
            )
        ordered = sorted(records, key=lambda r: (r.time_ms, r.rank))
        first = ordered[0]
        others = [{"rank": r.rank, "exc_type": r.exc_type, "exc_message": r.exc_message} for r in ordered[1:]]
        return cls(
            first.rank,
            first.exc_type,
            first.exc_message,
            first.traceback,
            describe_where(first.section, first.step, first.epoch),
            section=first.section,
            step=first.step,
            epoch=first.epoch,
            failed_at=first.time_ms / 1000.0,
            pid=first.pid or None,
            host=first.host,
            others=others,
        )

    def _format(self) -> str:
        who = "an unknown rank" if self.failed_rank is None else f"rank {self.failed_rank}"
        if self.section == WATCHDOG_SECTION:  # the message already says who and what
            text = f"{self.exc_type}: {self.exc_message}"
        else:
            text = f"{who} failed in {self.where or 'a fail-together section'}: {self.exc_type}: {self.exc_message}"
        if self.others:
            also = "; ".join(f"rank {o['rank']}: {o['exc_type']}: {o['exc_message']}" for o in self.others)
            text += f"\nalso failed: {also}"
        if self.remote_traceback:
            origin = f" (pid {self.pid} on {self.host})" if self.pid else ""
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
                    "others": self.others,
                },
            ),
        )


def _rebuild(failed_rank, exc_type, exc_message, remote_traceback, where, kwargs):
    return PeerFailedError(failed_rank, exc_type, exc_message, remote_traceback, where, **kwargs)
