"""Failure kinds as data: the kind of a failure (:class:`FailureKind`) and how a process ended
(:class:`Ended`), carried by failure records and :class:`~.errors.PeerFailedError`. Code decides
on these; the messages built from them are for people and are never read back."""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass
from enum import Enum
from typing import Any

_SIGNAL_NAMES = {int(s): s.name for s in _signal.Signals}
#: Largest signal number (Linux: 64, the last real-time signal) and exit code an :class:`Ended`
#: read back from the store may carry.
MAX_SIGNAL = 64
MAX_EXIT_CODE = 255


class FailureKind(str, Enum):
    """The kind of a failure. Its value is the name records and messages have always shown (a
    declared record's ``exc_type``), so the JSON in the store and the messages keep their text."""

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
        """The kind of a record or error of ``origin`` whose ``exc_type`` is ``exc_type``: a declared
        one's ``exc_type`` is its kind; anything else is an exception a rank raised."""
        if origin == "declared":
            try:
                return cls(exc_type)
            except ValueError:
                pass
        return cls.RAISED


#: The kinds a record of origin ``"declared"`` may have.
DECLARED_KINDS = (FailureKind.PEER_LOST, FailureKind.PEER_SILENT, FailureKind.RANK_HUNG, FailureKind.RANK_SIGNALLED)


@dataclass(frozen=True)
class Ended:
    """How a rank's process ended, as far as the rank that saw it could tell (``PeerLost``), or the
    signal a rank received and reported (``RankSignalled``).

    Attributes:
        exit_code: it exited with this code (0 to 255), or ``None``.
        signal: the number of the signal that killed it (or that it received), or ``None``.
        keeper_gone: the process that would have replaced it in place (its keeper,
            ``recover_in_place``) was gone too when it ended, as seen on its own host: nothing
            replaces it there, whatever its keeper announced when it started.

    Neither ``exit_code`` nor ``signal`` set: its process is gone and its exit status was not
    visible from where it was seen.
    """

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
        """Gone, with no exit status to see (a parent reaped it first)."""
        return self.exit_code is None and self.signal is None

    @property
    def signal_name(self) -> str | None:
        """``"SIGKILL"`` (``"signal 42"`` for a number without a name), or ``None``."""
        if self.signal is None:
            return None
        return _SIGNAL_NAMES.get(self.signal, f"signal {self.signal}")

    def describe(self) -> str:
        """``killed by SIGKILL``, ``exited with code 1``, or ``process is gone (exit status not visible
        from this process)``."""
        if self.signal is not None:
            how = f"killed by {self.signal_name}"
        elif self.exit_code is not None:
            how = f"exited with code {self.exit_code}"
        else:
            how = "process is gone (exit status not visible from this process)"
        return f"{how}, and its keeper is gone too" if self.keeper_gone else how

    @classmethod
    def from_json(cls, obj: Any) -> Ended | None:
        """An :class:`Ended` read back from a record (the store is unauthenticated): ``None`` unless
        ``obj`` is an object whose ``exit_code`` and ``signal`` are each null or an int in range, not
        both set, and whose ``keeper_gone``, if present, is a bool (other keys are ignored)."""
        if not isinstance(obj, dict):
            return None
        code, sig, keeper_gone = obj.get("exit_code"), obj.get("signal"), obj.get("keeper_gone", False)
        if not isinstance(keeper_gone, bool):
            return None
        if code is not None and not (is_int(code) and 0 <= code <= MAX_EXIT_CODE):
            return None
        if sig is not None and not (is_int(sig) and 1 <= sig <= MAX_SIGNAL):
            return None
        if code is not None and sig is not None:
            return None
        return cls(exit_code=code, signal=sig, keeper_gone=keeper_gone)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
