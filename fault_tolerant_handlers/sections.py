"""``fail_together`` and ``one_rank_first``: sections that end together on every rank."""

from __future__ import annotations

import logging
from types import TracebackType

import torch.distributed as dist

from ._log import log
from .coordinator import Coordinator, get_coordinator
from .errors import is_communication_error
from .record import FailureRecord


class fail_together:  # noqa: N801 - used like a function: ``with fail_together("load data"):``
    """Context manager: if the section raises on any rank, it raises on every rank.

    On exit every rank takes part in one all_reduce of an error flag on a gloo side group. If no
    rank failed, the section ends normally. If any rank failed, the failing rank re-raises its own
    exception unchanged and every other rank raises :class:`~fault_tolerant_handlers.PeerFailedError`
    naming the failing rank, its exception type, message and traceback, and ``where`` it failed.
    When several ranks fail in the same section, the earliest (by timestamp) is the cause and the
    others are listed in ``PeerFailedError.others``.

    Without a process group, or with a single rank, it is a plain context manager that adds nothing.

    Args:
        name: the section's name, used in every report (``"load data"``).
        group: the process group whose ranks fail together; ``None`` for all ranks.
        step, epoch: where the job is, for reports (adapters fill these in).

    Every rank of ``group`` must enter the same sections in the same order, exactly like a
    collective.

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers import fail_together, PeerFailedError

            with fail_together("load data"):
                dataset = build_dataset()      # raises on rank 1 only
            # rank 1 re-raises its own error; every other rank raises PeerFailedError:
            #   rank 1 failed in 'load data': ValueError: bad sample 17

        An exception that user code catches inside the section can still fail the section:

        .. code-block:: python

            with fail_together("evaluate") as section:
                try:
                    score = evaluate()
                except FileNotFoundError as err:
                    section.report_error(err)   # every rank raises at the end of the section
    """

    __slots__ = ("name", "group", "step", "epoch", "_coord", "_reported")

    def __init__(
        self, name: str, group: dist.ProcessGroup | None = None, *, step: int | None = None, epoch: int | None = None
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"fail_together(name=...) must be a non-empty str naming the section, got {name!r}")
        self.name = name
        self.group = group
        self.step = step
        self.epoch = epoch
        self._coord: Coordinator | None = None
        self._reported: BaseException | None = None

    def __enter__(self) -> fail_together:
        self._coord = get_coordinator(self.group, caller="fail_together")
        self._reported = None
        return self

    def report_error(self, exc: BaseException) -> None:
        """Mark the section as failed with ``exc`` although the code inside caught it.

        At the end of the section every rank raises: this rank raises ``exc``, the others
        :class:`~fault_tolerant_handlers.PeerFailedError`.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(f"report_error(exc=...) takes an exception instance, got {exc!r}")
        if self._reported is None:
            self._reported = exc

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        failure = exc if exc is not None else self._reported
        coord = self._coord
        if coord is None:
            if exc is None and failure is not None:
                raise failure
            return False
        if exc is not None and is_communication_error(exc):
            # A collective in the section failed: if a peer's failure is why (the watchdog released
            # this rank, or the peer died), raise that instead of a bare backend error.
            peer = coord.explain(exc)
            if peer is not None:
                coord.acknowledge()
                raise peer from exc
        peer_error = _agree(coord, self.name, failure, self.step, self.epoch)
        if failure is not None:
            if exc is None:  # reported, not raised: this rank raises its own failure now
                raise failure
            return False  # our own exception propagates unchanged
        if peer_error is not None:
            raise peer_error
        return False


def _agree(coord: Coordinator, name: str, failure: BaseException | None, step: int | None, epoch: int | None):
    seq = coord.next_seq()
    record = None
    if failure is not None:
        record = FailureRecord.from_exception(failure, rank=coord.rank, section=name, seq=seq, step=step, epoch=epoch)
        log(logging.ERROR, "failed in %r: %s: %s", name, record.exc_type, record.exc_message, step=step)
    peer_error = coord.agree(seq, record, section=name)
    if peer_error is not None and failure is None:
        log(logging.ERROR, "stopping: %s", str(peer_error).splitlines()[0], step=step)
        coord.acknowledge()
    return peer_error


def _check_rank(rank: int, local: bool, size: int) -> None:
    if not 0 <= rank < size:
        what = "ranks per node" if local else "world size"
        raise ValueError(
            # Ignite's own words first (code and tests matching them keep working), then ours
            f"one_rank_first(rank={rank}, local={local}): rank should be between 0 and {size - 1}, but given {rank} "
            f"(rank must be in [0, {size - 1}]: the {what} is {size})"
        )


class one_rank_first:  # noqa: N801 - a drop-in for ``ignite.distributed.one_rank_first``
    """Exception-safe drop-in for :func:`ignite.distributed.one_rank_first`.

    Rank ``rank`` (with ``local=True``: local rank ``rank`` on every node) runs the body first; the
    other ranks wait and then run it. Unlike the stock version, a failure never leaves a rank
    waiting:

    * the first rank raises inside the body: the waiting ranks are released at once and raise
      :class:`~fault_tolerant_handlers.PeerFailedError` **without running the body** (they never
      read a half-written dataset); the first rank re-raises its own exception;
    * a later rank raises inside the body: every rank raises (the failing one its own exception).

    Without a process group, or with a single rank, it is a plain context manager.

    Args:
        rank: the rank that goes first. Default 0.
        local: if True, local rank ``rank`` of each node goes first (e.g. a per-node cache).
        name: the section's name in reports.

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers import one_rank_first

            with one_rank_first(local=True):
                dataset = MNIST(root, download=True)   # local rank 0 downloads, then the others read

    Raises:
        TypeError, ValueError: ``rank`` is not an int in ``[0, world_size - 1]`` (local: ranks per node).
    """

    __slots__ = ("rank", "local", "name", "_coord", "_first")

    def __init__(self, rank: int = 0, local: bool = False, *, name: str = "one_rank_first") -> None:
        if not isinstance(local, bool):
            raise TypeError(f"one_rank_first(local=...) must be True or False, got {local!r}")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"one_rank_first(rank=...) must be an int in [0, world_size - 1], got {rank!r}")
        self.rank = rank
        self.local = local
        self.name = name
        self._coord: Coordinator | None = None
        self._first = True

    def __enter__(self) -> one_rank_first:
        coord = self._coord = get_coordinator(caller="one_rank_first")
        if coord is None:
            _check_rank(self.rank, self.local, 1)
            self._first = True
            return self
        size = coord.local_world_size if self.local else coord.world_size
        _check_rank(self.rank, self.local, size)
        mine = coord.local_rank if self.local else coord.rank
        self._first = mine == self.rank
        if not self._first:
            # Wait for the first rank(s) to finish the body; their outcome comes with the release.
            peer_error = _agree(coord, self.name, None, None, None)
            if peer_error is not None:
                raise peer_error
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        coord = self._coord
        if coord is None:
            return False
        if self._first:
            # Release the waiting ranks, telling them whether the body worked here.
            peer_error = _agree(coord, self.name, exc, None, None)
            if exc is not None:
                return False
            if peer_error is not None:  # another first rank (local=True) failed
                raise peer_error
        # Everyone has run the body: agree on the outcome of the later ranks.
        peer_error = _agree(coord, self.name, None if self._first else exc, None, None)
        if exc is not None:
            return False
        if peer_error is not None:
            raise peer_error
        return False
