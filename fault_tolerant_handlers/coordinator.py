"""The agreement every fail-together decision goes through.

A :class:`Coordinator` belongs to one process group (the world by default). It owns

* a **side group**: a gloo group over the same ranks, created once and collectively, so that the
  one-integer error-flag all_reduce never interleaves with the data group's collectives (NCCL or
  gloo);
* a **store namespace** ``fth/<run id>/`` in the c10d store the process group already has, where a
  failing rank publishes its :class:`~fault_tolerant_handlers.record.FailureRecord` as bounded JSON.

A decision is *record, agree, raise*: a failing rank publishes its record, then every rank
contributes to one ``all_reduce(MAX)`` of ``failing rank + 1`` (0 when it did not fail). A non-zero
result means somebody failed, and every rank then reads the records of that agreement.

Timeouts:
    The side group inherits the default store's timeout (that is, the ``timeout`` given to
    ``init_process_group``), because an agreement may legitimately wait as long as the slowest rank
    takes to reach it (``one_rank_first`` waits for a whole download). Override it with the
    ``timeout`` argument of :func:`get_coordinator` or with the environment variable
    ``FTH_SYNC_TIMEOUT_SEC`` (:data:`SYNC_TIMEOUT_ENV`).
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import logging
import os
import random
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import _dist
from ._log import log
from ._timeouts import check_timedelta, env_timedelta
from .errors import PeerFailedError
from .record import FailureRecord

#: Environment variable overriding the side group's timeout, in seconds.
SYNC_TIMEOUT_ENV = "FTH_SYNC_TIMEOUT_SEC"
#: Timeout of the store calls made on the failure path (reading records, host names).
FAILURE_PATH_STORE_TIMEOUT = timedelta(seconds=2)
#: At most this many records are read back for one agreement (failure path only).
MAX_RECORDS_READ = 256

_KEY_COUNT = "n"


def _record_key(index: int) -> str:
    return f"r/{index}"


def _host_id() -> int:
    digest = hashlib.sha1(socket.gethostname().encode("utf-8")).digest()
    return int.from_bytes(digest[:7], "big")


class Coordinator:
    """Side group plus store namespace for one process group. Build it with :func:`get_coordinator`."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: timedelta | None = None) -> None:
        self.group = group
        # Held so that the id() keying the registry cannot be reused by a later default group.
        self._default_group = _dist.default_group()
        self.rank = dist.get_rank()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.ranks = ranks
        self.world_size = len(ranks)
        self.group_rank = ranks.index(self.rank)
        store = _dist.default_store()
        timeout = check_timedelta("timeout", timeout, allow_none=True) or env_timedelta(SYNC_TIMEOUT_ENV, None) \
            or store.timeout
        self.timeout = timeout
        # Collective, once: every member reaches its first section in the same order.
        self.side = dist.new_group(
            ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=group is not None
        )
        # One all_gather at setup tells every rank the run id (rank 0's), each rank's host and pid.
        mine = torch.tensor([[random.getrandbits(62), _host_id(), os.getpid()]], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in ranks]
        dist.all_gather(gathered, mine, group=self.side)
        table = torch.cat(gathered)
        self.run_id = f"{int(table[0, 0]):x}"
        self.host_ids = table[:, 1].tolist()
        self.pids = table[:, 2].tolist()
        self.local_rank, self.local_world_size = self._local_layout()
        self.store = dist.PrefixStore(f"fth/{self.run_id}", store)
        # Host names are only needed in reports: one small key per rank, read on the failure path.
        self.store.set(f"host/{self.rank}", socket.gethostname()[:200])
        # Failure-path reads use their own connection with a short timeout: the store's host may be
        # the rank that just died, with a child process still holding its socket open.
        self._failure_store = self.store.clone()
        self._failure_store.set_timeout(FAILURE_PATH_STORE_TIMEOUT)
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._seq = 0
        #: Records up to this index were delivered at a sync point (the watchdog leaves them alone).
        self.consumed_index = 0
        self.watchdog = None  # set by start_watchdog()
        self._lock = threading.Lock()
        log(logging.DEBUG, "fault-tolerance side group ready (run %s, %d ranks)", self.run_id, self.world_size)

    def _local_layout(self) -> tuple[int, int]:
        """Local rank and ranks per node: from the launcher's env when set, else from host ids."""
        env_rank, env_size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
        if env_rank is not None and env_size is not None and self.group is None:
            try:
                return int(env_rank), int(env_size)
            except ValueError:
                pass
        me = self.host_ids[self.group_rank]
        same = [i for i, h in enumerate(self.host_ids) if h == me]
        return same.index(self.group_rank), len(same)

    def host_name(self, rank: int, store: dist.Store | None = None) -> str:
        """The host name rank ``rank`` announced (bounded; ``"?"`` when unknown)."""
        store = store or self._failure_store
        try:
            key = f"host/{rank}"
            if store.check([key]):
                return store.get(key)[:200].decode("utf-8", "replace")
        except Exception:  # noqa: BLE001
            pass
        return "?"

    # -- record -------------------------------------------------------------------------------
    def publish(self, record: FailureRecord) -> None:
        """Write this rank's failure record to the store (before it joins the agreement)."""
        if self.watchdog is not None:
            self.watchdog.local_failure()  # this rank raises its own error: never released or exited
        try:
            index = self.store.add(_KEY_COUNT, 1)
            self.store.set(_record_key(index), record.to_json())
        except Exception as err:  # the flag still carries the rank; never mask the real failure
            log(logging.WARNING, "could not publish the failure record: %s", err)

    def read_record(self, index: int, store: dist.Store | None = None) -> FailureRecord | None:
        """Record number ``index``, or ``None`` (absent, unreadable or malformed: never executed)."""
        store = store or self._failure_store
        key = _record_key(index)
        try:
            if not store.check([key]):
                return None
            return FailureRecord.from_json(store.get(key))
        except Exception as err:  # noqa: BLE001
            log(logging.WARNING, "could not read failure record %d: %s", index, err)
            return None

    def read_records(self, seq: int | None) -> list[FailureRecord]:
        """The valid records of agreement ``seq`` (all unconsumed ones when ``None``), newest first."""
        try:
            count = self._failure_store.add(_KEY_COUNT, 0)
        except Exception as err:  # noqa: BLE001
            log(logging.WARNING, "could not read failure records: %s", str(err).splitlines()[0][:200])
            return []
        found: list[FailureRecord] = []
        for index in range(count, max(self.consumed_index, count - MAX_RECORDS_READ), -1):
            record = self.read_record(index)
            if record is None:
                continue
            if seq is None or record.seq == seq:
                found.append(record)
            elif 0 <= record.seq < seq:
                break
        self.consumed_index = max(self.consumed_index, count)
        return found

    def explain(self, err: BaseException, wait: float = 2.0) -> PeerFailedError | None:
        """Why a collective of this rank failed, if another rank is the cause.

        Looks at what the watchdog already knows and at unconsumed records from other ranks,
        for up to ``wait`` seconds (a killed peer is declared by a watchdog within ~0.1 s).
        """
        if self.watchdog is not None:
            known = self.watchdog.peer_error or self.watchdog.dead_peer_now()
            if known is not None:
                return known
        deadline = time.monotonic() + wait
        found: list[FailureRecord] = []
        done = threading.Event()

        def reader() -> None:
            # Its own thread: a store call can block when the store's host died with its socket
            # still held open by a child process; the main thread never waits past the deadline.
            while not done.is_set() and time.monotonic() < deadline:
                records = [r for r in self.read_records(None) if r.rank != self.rank]
                if records:
                    found.extend(records)
                    break
                time.sleep(0.05)
            done.set()

        thread = threading.Thread(target=reader, name="fth-store-read", daemon=True)
        thread.start()
        try:
            while time.monotonic() < deadline:
                if self.watchdog is not None and self.watchdog.peer_error is not None:
                    return self.watchdog.peer_error
                if found:
                    return PeerFailedError.from_records(found)
                if done.is_set():
                    break
                time.sleep(0.02)
            if found:
                return PeerFailedError.from_records(found)
            return None
        finally:
            done.set()
            # Let it leave its store call (bounded by the failure-path timeout) before going on:
            # a daemon thread inside a torch call at interpreter exit aborts the process.
            thread.join(timeout=FAILURE_PATH_STORE_TIMEOUT.total_seconds() + 0.5)

    def acknowledge(self) -> None:
        """The main thread takes a peer's failure and raises it: no reported exit by the watchdog,
        and an orderly teardown of the (released) process groups at interpreter exit."""
        from .release import teardown_at_exit

        if self.watchdog is not None:
            self.watchdog.acknowledge()
        teardown_at_exit()

    # -- agree ---------------------------------------------------------------------------------
    def next_seq(self) -> int:
        with self._lock:
            seq = self._seq
            self._seq += 1
            return seq

    def agree(self, seq: int, record: FailureRecord | None, section: str = "") -> PeerFailedError | None:
        """Publish ``record`` if given, take part in the flag all_reduce, and say what happened.

        Returns ``None`` when no rank failed, else the :class:`PeerFailedError` describing the
        earliest failure (the caller decides whether to raise it or its own exception).
        """
        if record is not None:
            self.publish(record)
        self._flag.fill_(0 if record is None else self.rank + 1)
        try:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.side)
        except Exception as err:
            if record is not None:
                return None  # this rank failed: it re-raises its own exception whatever the peers did
            # A peer vanished or failed elsewhere, and this rank was released: say who and why.
            explained = self.explain(err)
            if explained is not None:
                return explained
            raise PeerFailedError(
                None,
                type(err).__name__,
                f"the fail-together agreement itself failed: {err}",
                where="the fail-together agreement",
            ) from err
        flag = int(self._flag.item())
        if flag == 0:
            return None
        records = self.read_records(seq)
        return PeerFailedError.from_records(records, fallback_rank=flag - 1, section=section)


_registry: dict[tuple[int, int], Coordinator] = {}
_registry_lock = threading.Lock()


def _forget_all() -> None:
    """At interpreter exit, drop the side groups and store clients while Python is fully alive, so
    their C++ destructors do not run late in finalization."""
    with _registry_lock:
        _registry.clear()
    gc.collect()


def get_coordinator(
    group: dist.ProcessGroup | None = None, *, timeout: timedelta | None = None, caller: str = "fail_together"
) -> Coordinator | None:
    """The coordinator for ``group`` (the world when ``None``), or ``None`` when there is nothing to
    coordinate (no process group and no multi-rank launcher, or a single rank).

    Raises:
        RuntimeError: the launcher says this is a multi-rank job but ``init_process_group`` has not
            been called yet.
        ValueError: this process is not a member of ``group``.
    """
    if not _dist.initialized():
        if group is not None:
            raise RuntimeError(
                f"{caller}(group=...) was given a process group, but torch.distributed is not initialized; "
                "call torch.distributed.init_process_group() first"
            )
        world = _dist.launcher_world_size()
        if world > 1:
            raise RuntimeError(
                f"{caller} was called in a job of WORLD_SIZE={world} ranks before "
                "torch.distributed.init_process_group(); call it after the process group is initialized "
                "(init_process_group, idist.Parallel, or inside the Trainer's hooks)"
            )
        return None
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(
            f"{caller}(group=...): this process (global rank {dist.get_rank()}) is not a member of the given group "
            f"(ranks {dist.get_process_group_ranks(group)}); pass a group that contains this rank, or group=None for all ranks"
        )
    world = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if world <= 1:
        return None
    key = (id(_dist.default_group()), id(group))
    coordinator = _registry.get(key)
    if coordinator is None:
        with _registry_lock:
            coordinator = _registry.get(key)
            if coordinator is None:
                # A new default group (destroy + init) makes every older coordinator stale.
                for stale in [k for k in _registry if k[0] != key[0]]:
                    del _registry[stale]
                coordinator = Coordinator(group, timeout=timeout)
                if not _registry:
                    atexit.register(_forget_all)  # registered after torch's own exit hooks: runs before them
                _registry[key] = coordinator
    return coordinator
