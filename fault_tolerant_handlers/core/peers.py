"""What a probe found (:class:`Finding`), and the one probe the core runs itself: same-host peers
by pid (:class:`PeerPidProbe`), which the session consults at once when a collective breaks (no
thread, no store). The other probes are the detectors' (:mod:`..detect.probes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import PeerFailedError
from .failure import Ended, FailureRecord
from .procfs import process_state


@dataclass(frozen=True)
class Finding:
    """What a probe found. ``error`` is what this rank's main thread must raise; ``declare`` is a
    record to publish on behalf of the failed rank (the first rank to declare it does);
    ``hung_self``: this rank itself is hung and must end."""

    error: PeerFailedError
    declare: FailureRecord | None = None
    hung_self: bool = False


def declared_finding(record: FailureRecord) -> Finding:
    return Finding(PeerFailedError.from_records([record]), declare=record)


#: How :func:`~.procfs.process_state` says a process ended cleanly: not a failure (a rank that
#: finished first); if this rank then waits on it, the broken collective names it.
CLEAN_EXIT = Ended(exit_code=0)


class PeerPidProbe:
    """Peers on this host, by pid: a process that is gone is declared lost (with the signal when
    the kernel still shows it; a clean exit is not a failure). A system call per peer; the store is
    asked only about a peer gone with no exit status to see (a launcher that reaps at once):
    ``left(rank)`` true (it stopped its watchdog cleanly first: ``left/<rank>``) means it finished
    first, and it is no longer watched."""

    def __init__(self, peers: Sequence[tuple[int, int]], *, by: int, host: str,
                 state: Callable[[int], Ended | None] = process_state,
                 after_failure: Callable[[], bool] = lambda: False,
                 left: Callable[[int], bool] = lambda rank: False) -> None:
        self.after_failure = after_failure  # once the job failed, peers leaving is expected
        self.left = left
        self.peers = list(peers)  # (global rank, pid)
        self.by = by
        self.host = host
        self.state = state

    def poll(self, now: float) -> Finding | None:
        for rank, pid in list(self.peers):
            state = self.state(pid)
            if state is None or state == CLEAN_EXIT:
                continue
            if self.after_failure() and not state.killed:
                continue  # a peer that ended after the failure was agreed: the job is ending
            if state.unseen and self._left(rank):
                # gone, its exit status not visible (a launcher that reaps at once), after it
                # finished first: no failure, and no longer watched. A status that shows a failure
                # (a signal, a non-zero code: ``sys.exit(1)`` under ``mp.spawn`` leaves no uncaught
                # exception for the left mark to see) is declared, left mark or not.
                self.peers.remove((rank, pid))
                continue
            return declared_finding(FailureRecord.lost(rank=rank, pid=pid, host=self.host, why=state, by=self.by))
        return None

    def _left(self, rank: int) -> bool:
        try:
            return self.left(rank)
        except Exception:  # noqa: BLE001 - no answer is no evidence that it left: declared as before
            return False
