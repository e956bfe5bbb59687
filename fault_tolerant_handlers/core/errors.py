"""Named errors raised when ranks fail together (the failure itself: :mod:`.failure`)."""

from __future__ import annotations

from .failure import FailureKind, PeerFailedError

#: Exit code of a rank ended by the watchdog because another rank failed, was lost or hung.
EXIT_PEER_FAILED = 87
#: Exit code of the rank that declared itself hung.
EXIT_HUNG = 88


def store_lost(address: str, why: str) -> PeerFailedError:
    """The c10d store on a host of no rank's (``address``: ``host:port``) is lost: no rank is to blame."""
    at = f" at {address}" if address else ""
    return PeerFailedError(None, FailureKind.STORE_LOST.value, f"the c10d store{at}, on a host of no rank's, is lost: {why}",
                           origin="declared", kind=FailureKind.STORE_LOST)


class SectionMismatchError(RuntimeError):
    """The ranks met in different fail-together sections or agreements: a bug in the job, like a
    collective called on some ranks only. Raised on every rank of the agreement.

    Attributes:
        sections: ``{rank: "fail_together 'x' (agreement 3)", ...}`` for the ranks that could say.
    """

    def __init__(self, message: str, sections: dict[int, str] | None = None) -> None:
        self.sections = dict(sections or {})
        super().__init__(message)

    def __reduce__(self):
        return (SectionMismatchError, (str(self), self.sections))


SectionMismatchError.__module__ = "fault_tolerant_handlers.errors"  # its public path, as pickles name it


class HangInterrupted(BaseException):
    """Raised in a hung rank's main thread, where it hangs, when the job recovers in place
    (``recover_in_place`` with ``hang_timeout``). A ``BaseException``, like ``KeyboardInterrupt``: code
    that swallows it meets it again at the library's next hook; it waits outside
    :class:`~fault_tolerant_handlers.deferred_interrupt` sections."""


class StateTransferError(RuntimeError):
    """A transfer of live state over the re-formed group failed: raised on every rank together, which
    all fall back to the newest checkpoint.

    Attributes:
        source: the group rank that sent.
        failures: ``{group rank: (kind, chunk)}`` for every rank that failed; ``kind`` is a
            :class:`~..recover.transfer.TransferFailure` value, ``chunk`` the 0-based chunk
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
    """Recovering in place could not go on (the message says why; the attempt's exception, if any, is
    its ``__cause__``): the job ends as it would have without recovery in place."""
