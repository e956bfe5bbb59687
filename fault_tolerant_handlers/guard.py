"""The framework-neutral core of the adapters: what a training loop calls at each of its hooks.

An adapter (Ignite handler, Lightning callback) maps its framework's events onto four calls:

* :meth:`Guard.start` once, on every rank, before training (collective: creates the side group and
  starts the watchdog);
* :meth:`Guard.beat` every iteration (a couple of assignments: progress for hang detection);
* :meth:`Guard.sync` at the points where every rank already synchronises (every ``sync_every``
  iterations, epoch end, before a checkpoint, the end of the run): one small all_reduce, and every
  rank raises :class:`PeerFailedError` together if any rank failed;
* :meth:`Guard.on_exception` when the framework reports an exception: it tells a local failure
  (record it, release the peers, re-raise it) from a consequence of a peer's failure (raise
  :class:`PeerFailedError` with the peer's cause instead of a bare gloo error).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from ._log import log
from .coordinator import Coordinator, get_coordinator
from .errors import PeerFailedError, is_communication_error
from .record import FailureRecord
from .release import release_process_groups
from ._timeouts import check_timedelta
from .watchdog import Watchdog, start_watchdog

#: Marks an exception object this process already handled (published or converted).
_HANDLED_ATTR = "_fth_handled"

class Guard:
    """Fail-together state for one training loop on one process group.

    Args:
        sync_every: iterations between flag agreements inside an epoch (``None``: only at epoch
            ends and the other natural sync points). The watchdog covers what happens in between.
        hang_timeout: declare a rank hung when its loop makes no progress for this long
            (``None``: off). Env override ``FTH_HANG_TIMEOUT_SEC``.
        watchdog: start the out-of-band watchdog (default True).
        release_on_failure: when this rank fails, release its collectives at once so that peers
            blocked in a collective with it fail fast instead of waiting for a timeout.
        name: the loop's name in reports (``"train"``).
        group: process group (``None``: all ranks).
    """

    def __init__(
        self,
        *,
        sync_every: int | None = 100,
        hang_timeout: timedelta | None = None,
        watchdog: bool = True,
        release_on_failure: bool = True,
        name: str = "train",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if sync_every is not None and (isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"sync_every must be a positive int (iterations) or None, got {sync_every!r}")
        check_timedelta("hang_timeout", hang_timeout, allow_none=True)
        if not isinstance(watchdog, bool):
            raise TypeError(f"watchdog must be True or False, got {watchdog!r}")
        self.sync_every = sync_every
        self.hang_timeout = hang_timeout
        self.use_watchdog = watchdog
        self.release_on_failure = release_on_failure
        self.name = name
        self.group = group
        self.coord: Coordinator | None = None
        self.watchdog: Watchdog | None = None
        self.failures_seen = 0

    @property
    def active(self) -> bool:
        return self.coord is not None

    def start(self) -> None:
        """Collective on first use: call on every rank before training. A no-op without distribution."""
        self.coord = get_coordinator(self.group, caller=type(self).__name__)
        if self.coord is not None and self.use_watchdog:
            self.watchdog = start_watchdog(self.group, hang_timeout=self.hang_timeout)

    def stop(self) -> None:
        """The loop ended normally on every rank."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def beat(self, step: int | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def due(self, iteration: int) -> bool:
        return self.sync_every is not None and iteration % self.sync_every == 0

    def sync(self, where: str, *, step: int | None = None, epoch: int | None = None) -> None:
        """One agreement: raise :class:`PeerFailedError` on every rank if any rank failed."""
        coord = self.coord
        if coord is None:
            return
        if self.watchdog is not None and self.watchdog.peer_error is not None:
            self._raise_peer(self.watchdog.peer_error)
        peer_error = coord.agree(coord.next_seq(), None, section=self.name)
        if peer_error is not None:
            self._raise_peer(peer_error)

    def _acknowledge(self) -> None:
        if self.coord is not None:
            self.coord.acknowledge()

    def _raise_peer(self, err: PeerFailedError) -> None:
        self._acknowledge()
        setattr(err, _HANDLED_ATTR, True)
        log(logging.ERROR, "stopping: %s", str(err).splitlines()[0])
        raise err

    def on_exception(self, exc: BaseException, *, step: int | None = None, epoch: int | None = None) -> BaseException:
        """What this rank must raise for ``exc``: ``exc`` itself, or a :class:`PeerFailedError`.

        A local failure is published for the other ranks (and this rank's collectives are released
        so that a peer blocked in one with it wakes up at once). An error that comes from a peer's
        failure (a released or broken collective) becomes the peer's :class:`PeerFailedError`.
        Idempotent: the same exception object is handled once.
        """
        coord = self.coord
        if coord is None or getattr(exc, _HANDLED_ATTR, False):
            return exc
        if isinstance(exc, PeerFailedError):
            self._acknowledge()
            _mark(exc)
            return exc
        if is_communication_error(exc):
            peer = coord.explain(exc)
            if peer is not None:
                self._acknowledge()
                _mark(peer)
                peer.__cause__ = exc
                log(logging.ERROR, "stopping: %s", str(peer).splitlines()[0], step=step)
                return peer
        # A failure of this rank: record it, then make sure no peer waits for us.
        self.failures_seen += 1
        record = FailureRecord.from_exception(exc, rank=coord.rank, section=self.name, seq=-1, step=step, epoch=epoch)
        log(logging.ERROR, "failed: %s: %s", record.exc_type, record.exc_message, step=step)
        coord.publish(record)
        if self.release_on_failure:
            what = release_process_groups(coord.store)
            log(logging.INFO, "released this rank's collectives so that no peer waits: %s", what, step=step)
        _mark(exc)
        return exc


def _mark(exc: BaseException) -> None:
    try:
        setattr(exc, _HANDLED_ATTR, True)
    except Exception:  # noqa: BLE001 - some exception types refuse attributes
        pass
