"""``fail_together`` and ``one_rank_first``: sections that end together on every rank (docs/primitives.md)."""

from __future__ import annotations

import logging
from types import TracebackType

import torch.distributed as dist

from . import inject
from .hooks import first_line, log
from .compat_torch import is_backend_error
from .failure import PeerFailedError, tag, tag_of
from .session import Session, check_name, get_session


def check_position(owner: str, arg: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{owner}({arg}=...) must be a non-negative int or None, got {value!r}")
    return value


def conclude(session: Session, kind: str, name: str, exc: BaseException | None, reported: BaseException | None = None,
             *, step: int | None = None, epoch: int | None = None) -> BaseException | None:
    """End a section on this rank: what it must raise (``exc`` itself, a peer's error, a mismatch), or
    ``None``; a broken collective a peer's failure explains becomes that error with no agreement."""
    if exc is not None and tag_of(exc).agreed:
        return exc
    failure = exc if exc is not None else reported
    peer = failure if isinstance(failure, PeerFailedError) else None
    if failure is not None and peer is None and is_backend_error(failure):
        explained = session.classify(failure)
        if explained is not None:
            return _peer(session, explained, step)
    err = session.agree(kind, name, None if peer is not None else failure, step=step, epoch=epoch, peer=peer)
    if failure is not None and peer is None:
        tag(failure, agreed=True)
        return failure
    return None if err is None else _peer(session, err, step)


def _peer(session: Session, err: BaseException, step: int | None) -> BaseException:
    session.acknowledge(err)
    tag(err, agreed=True)
    log(logging.ERROR, "stopping: %s", first_line(err, None), step=step)
    return err


def _raise(err: BaseException | None, exc: BaseException | None) -> bool:
    """``__exit__``'s ending: let ``exc`` propagate, or raise ``err`` instead of it."""
    if err is None or err is exc:
        return False
    if exc is not None:
        raise err from exc
    raise err


class fail_together:  # noqa: N801 - used like a function: ``with fail_together("load data"):``
    """Context manager: if the section raises on any rank, it raises on every rank.

    On exit every rank takes part in one agreement on a gloo side group: the failing rank re-raises
    its own exception, every other rank raises :class:`~fault_tolerant_handlers.PeerFailedError`
    naming it. Every rank of ``group`` must enter the same sections in the same order, like a
    collective (else :class:`~fault_tolerant_handlers.SectionMismatchError`). Without a process
    group, or with a single rank, it adds nothing.

    Args:
        name: the section's name, used in every report (``"load data"``).
        group: the process group whose ranks fail together; ``None`` for all ranks.
        step, epoch: where the job is, for reports (non-negative ints); with ``step`` the section fires
            the ``FTH_INJECT`` injection for this iteration as it begins.

    Raises:
        TypeError: ``name`` is not a non-empty str, ``group`` not a process group, ``step`` or
            ``epoch`` not a non-negative int.

    Examples:
        .. code-block:: python

            with fail_together("load data"):
                dataset = build_dataset()      # raises on rank 1 only: the others raise PeerFailedError

            with fail_together("evaluate") as section:
                try:
                    score = evaluate()
                except FileNotFoundError as err:
                    section.report_error(err)   # every rank raises at the end of the section
    """

    __slots__ = ("name", "group", "step", "epoch", "_session", "_reported")

    def __init__(self, name: str, group: dist.ProcessGroup | None = None, *, step: int | None = None,
                 epoch: int | None = None) -> None:
        self.name = check_name("fail_together", name)
        if group is not None and not isinstance(group, dist.ProcessGroup) and group != dist.GroupMember.NON_GROUP_MEMBER:
            raise TypeError(f"fail_together(group=...) must be a torch.distributed.ProcessGroup or None, got {group!r}")
        self.group = group
        self.step = check_position("fail_together", "step", step)
        self.epoch = check_position("fail_together", "epoch", epoch)
        self._session: Session | None = None
        self._reported: BaseException | None = None

    def __enter__(self) -> fail_together:
        self._session = get_session(self.group, caller="fail_together")
        self._reported = None
        injector = inject.plain_injector()  # FTH_INJECT: rehearse a failure in a loop of your own
        if injector is not None and self.step is not None:
            try:
                injector.maybe_fire(inject.current_rank(), self.step, self.epoch)
            except BaseException as exc:  # raised in the section: it ends as any failure in it does
                if not self.__exit__(type(exc), exc, exc.__traceback__):
                    raise
        return self

    def report_error(self, exc: BaseException) -> None:
        """Mark the section as failed with ``exc`` although the code inside caught it: at its end this
        rank raises ``exc``, the others :class:`~fault_tolerant_handlers.PeerFailedError`."""
        if not isinstance(exc, BaseException):
            raise TypeError(f"report_error(exc=...) takes an exception instance, got {exc!r}")
        if self._reported is None:
            self._reported = exc

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        session = self._session
        if session is None:
            return _raise(self._reported if exc is None else None, exc)
        err = conclude(session, "fail_together", self.name, exc, self._reported, step=self.step, epoch=self.epoch)
        return _raise(err, exc)


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

    Rank ``rank`` (``local=True``: local rank ``rank`` on every node) runs the body first, then the
    others. If the first rank raises, the waiting ranks raise
    :class:`~fault_tolerant_handlers.PeerFailedError` without running the body; if a later rank
    raises, every rank raises. Without a process group, or with a single rank, it adds nothing.

    Args:
        rank: the rank that goes first. Default 0.
        local: if True, local rank ``rank`` of each node goes first (e.g. a per-node cache).
        name: the section's name in reports.

    Examples:
        .. code-block:: python

            with one_rank_first(local=True):
                dataset = MNIST(root, download=True)   # local rank 0 downloads, then the others read

    Raises:
        TypeError, ValueError: ``rank`` is not an int in ``[0, world_size - 1]`` (local: ranks per
            node); ``local`` is not a bool; ``name`` is not a non-empty str.
    """

    __slots__ = ("rank", "local", "name", "_session", "_first")

    def __init__(self, rank: int = 0, local: bool = False, *, name: str = "one_rank_first") -> None:
        if not isinstance(local, bool):
            raise TypeError(f"one_rank_first(local=...) must be True or False, got {local!r}")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"one_rank_first(rank=...) must be an int in [0, world_size - 1], got {rank!r}")
        self.rank = rank
        self.local = local
        self.name = check_name("one_rank_first", name)
        self._session: Session | None = None
        self._first = True

    def __enter__(self) -> one_rank_first:
        session = self._session = get_session(caller="one_rank_first")
        if session is None:
            _check_rank(self.rank, self.local, 1)
            self._first = True
            return self
        size = session.table.local_world_size if self.local else session.world_size
        _check_rank(self.rank, self.local, size)
        mine = session.table.local_rank if self.local else session.rank
        self._first = mine == self.rank
        if not self._first:
            # Wait for the first rank(s) to finish the body; their outcome comes with the release.
            err = conclude(session, "one_rank_first:first", self.name, None)
            if err is not None:
                raise err
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        session = self._session
        if session is None:
            return False
        if self._first:
            # Release the waiting ranks, telling them whether the body worked here.
            err = conclude(session, "one_rank_first:first", self.name, exc)
            if err is not None:
                return _raise(err, exc)
            exc = None
        # Everyone has run the body: agree on the outcome of the later ranks.
        return _raise(conclude(session, "one_rank_first:rest", self.name, exc), exc)
