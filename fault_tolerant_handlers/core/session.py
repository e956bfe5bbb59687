"""The fail-together session: one object per process group in this process that owns every decision:
its gloo side group, store keys, agreement (:meth:`Session.agree`), classification of an exception
as this rank's own or a peer's (:meth:`Session.classify`), failure state and watchdog (docs/architecture.md)."""

from __future__ import annotations

import atexit
import contextlib
import gc
import ipaddress
import logging
import os
import re
import secrets
import socket
import threading
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from . import compat_torch as _compat_torch
from . import attempts, config, hooks, schema as _schema
from .errors import RecoveryError, SectionMismatchError
from .failure import FailureKind, FailureRecord, FailureState, Incident, PeerFailedError, host_name, tag, tag_of
from .hooks import first_line, log
from .procfs import (PeerPidProbe, RankTable, addresses_named, decode_name, digest, encode_name, listens_here,
                     local_layout, normalize_address, own_address, store_peer_address)
from .interrupts import raise_pending, release_process_groups, store_ports, teardown_at_exit
from .schema import Connection, Schema, probe_store_port, store_evidence
from .config import (BACKGROUND_CONNECT_TIMEOUT, EXPLAIN_EVIDENCE_TIMEOUT, EXPLAIN_WAIT, FAILURE_PATH_STORE_TIMEOUT,  # timings: the table
                     LEAVE_WAIT, MAIN_STORE_TIMEOUT, MISMATCH_WAIT, SUSPECT_OBSERVED_GAP, SUSPECT_SILENCE)  # in .config

#: How many delivered record indices are remembered for the watchdog.
MAX_DELIVERED = 1024
#: Bits of the section hash and of the agreement's sequence number in the agreement's two integers.
_FIELD_BITS = 20
_FIELD = (1 << _FIELD_BITS) - 1
#: The largest flag (a rank + 1) the first integer holds above them.
MAX_FLAG = (1 << (63 - 2 * _FIELD_BITS)) - 1


def pack_agreement(flag: int, digest: int, seq: int) -> tuple[int, int]:
    """The two int64 every rank contributes to one agreement, reduced by MAX: ``a = flag | hash | seq``
    carries the largest flag and (hash, seq) pair, ``b = (M - hash) | (M - seq)`` the smallest pair;
    every rank is in step exactly when the two pairs are equal."""
    h, s = digest & _FIELD, seq & _FIELD
    return (flag << 2 * _FIELD_BITS) | (h << _FIELD_BITS) | s, ((_FIELD - h) << _FIELD_BITS) | (_FIELD - s)


def unpack_agreement(a: int, b: int) -> tuple[int, bool]:
    """``(the largest flag, whether every rank was in step)`` from the reduced pair."""
    low = (1 << 2 * _FIELD_BITS) - 1  # (hash, seq) as one number: b's low bits are its complement
    return a >> 2 * _FIELD_BITS, a & low == low - (b & low)


class Session:
    """Side group, store keys, agreement, classification and watchdog of one process group (:func:`get_session`)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        _compat_torch.check()
        self.config = config.load()
        self.group = group
        # Held so that the id() keying the registry cannot be reused by a later default group.
        self._default_group = _compat_torch.default_group()
        rank = dist.get_rank()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        #: The default process group's store (what releasing this process's collectives cuts).
        self.pg_store = _compat_torch.default_store()
        timeout = self.config.sync_timeout or self.pg_store.timeout
        # Collective, once: every member reaches its first section in the same order.
        self.side = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout,
                                   use_local_synchronization=group is not None)
        # One all_gather at setup: the run id (rank 0's, from ``secrets``: not a user's seeded generator),
        # each rank's host id, pid, address hash, whether the store is on its host, and host name.
        self.address = own_address()
        self.keep_ports = store_ports(self.pg_store)
        tcp = _compat_torch.tcp_store_of(self.pg_store)
        #: ``(host, port)`` of the TCP store, or ``None`` (another kind of store: it cannot be lost).
        self.store_address: tuple[str, int] | None = (tcp.host, tcp.port) if tcp is not None else None
        #: This process hosts the store (its server is a thread here): it never declares it lost.
        self.hosts_store = self.store_address is not None and listens_here(self.store_address[1])
        mine = torch.tensor([[secrets.randbits(62), digest(host_name()), os.getpid(), digest(self.address),
                              self._store_here(), *encode_name(host_name())]], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in ranks]
        dist.all_gather(gathered, mine, group=self.side)
        table = torch.cat(gathered)
        self.run_id = f"{int(table[0, 0]):x}"
        host_ids = table[:, 1].tolist()
        #: Who the ranks are (read-only): what probes and reporters are given instead of the session.
        self.table = RankTable(rank, tuple(ranks), tuple(table[:, 2].tolist()),
                               tuple(decode_name(row[5:].tolist()) for row in table), tuple(host_ids),
                               tuple(table[:, 3].tolist()),
                               *local_layout(host_ids, ranks.index(rank), whole_world=group is None))
        #: The first rank on the store's host (:func:`store_rank_of`), or ``None``.
        self.store_rank: int | None = store_rank_of(list(ranks), table[:, 4].tolist())
        self.schema = Schema(self.connection("main", MAIN_STORE_TIMEOUT), world_size=dist.get_world_size())
        self._flag = torch.zeros(2, dtype=torch.int64)
        self._seq = 0
        #: The oldest agreement a failure record can still belong to (the one in progress, else the next).
        self.live_seq = 0
        #: The record counter as the last agreement read it (the run is new: 0). Main thread only.
        self.consumed = 0
        #: Record indices agreements delivered (the watchdog leaves them alone); replaced, never mutated.
        self.delivered: frozenset[int] = frozenset()
        #: The main thread is in an agreement's all_reduce: a sync point that delivers a peer's record.
        self.agreeing = False
        #: Has this job failed? This attempt's failure state on this group (:mod:`.failure`).
        self.failure = FailureState()
        self._watchdog = None
        self._watchdog_refs = 0
        self._kept_liveness = None  # the liveness helper a recovery keeps until abandon()
        self._left = False  # this rank's left mark is in the store (its watchdog stopped cleanly)
        self._lock = threading.Lock()
        #: Same-host peers by pid, consulted at once when a collective breaks (and by the signal handler).
        self.same_host_probe = PeerPidProbe(self.table.same_host_peers(), by=self.rank, host=self.host)
        self._explaining = None
        hooks.emit(hooks.SESSION_STARTED, self)  # the launchers: signal handlers, mp.spawn's report
        log(logging.DEBUG, "fault-tolerance side group ready (run %s, %d ranks)", self.run_id, self.world_size)

    # -- the ranks (the rest in :attr:`table`) and connections --------------------------------------
    rank = property(lambda self: self.table.rank, doc="This process's global rank.")
    ranks = property(lambda self: list(self.table.ranks), doc="The group's global ranks, in group order.")
    world_size = property(lambda self: self.table.world_size)
    host = property(lambda self: self.table.host, doc="This rank's host name.")

    def release_collectives(self) -> str:
        """Release this process's blocked collectives (a peer's failure, or its own): what was cut."""
        return release_process_groups(self.pg_store, self.config.release)

    def connection(self, name: str, timeout: timedelta, *, backoff: bool = False,
                   prefix: str | None = None) -> Connection:
        """A new store connection of this process's own, under the run's prefix (a TCP store: a new
        client whose connect is bounded by ``timeout``; another store: cloned)."""
        prefix, base = f"fth/{self.run_id}" if prefix is None else prefix, self.pg_store

        def prefixed(store: dist.Store) -> dist.Store:
            return dist.PrefixStore(prefix, store) if prefix else store

        # a loop's connection connects in its own thread: a slow connect is waited for, not made again
        connect = max(timeout, BACKGROUND_CONNECT_TIMEOUT) if backoff else timeout
        if self.store_address is not None:
            host, port = self.store_address
            made = []

            def factory() -> dist.Store:
                # the port is tried first but for a loop's first connect at start (the store was just
                # reached): each try costs the store's server a reverse DNS lookup in its only thread
                if made or not backoff:
                    probe_store_port(host, port, connect)
                made.append(True)
                return prefixed(dist.TCPStore(host, port, is_master=False, timeout=connect, wait_for_workers=False))
        else:
            def factory() -> dist.Store:
                return prefixed(base.clone())
        return Connection(factory, timeout, name, backoff=backoff, connect_timeout=connect)

    def _store_here(self) -> int:
        """Whether the store runs on this host, from where this process's connection to it goes."""
        if self.store_address is None:
            return STORE_UNSEEN
        if self.hosts_store:
            return STORE_HERE
        peer = store_peer_address(self.keep_ports)
        if peer is None:
            return STORE_UNSEEN
        return STORE_HERE if is_local_address(normalize_address(peer)) else STORE_ELSEWHERE

    def store_evidence(self, timeout: float) -> str | None:
        """:func:`~.schema.store_evidence` (``None`` too for a store this process hosts, or not TCP)."""
        if self.store_address is None or self.hosts_store:
            return None
        return store_evidence(*self.store_address, timeout)

    # -- the failure state -------------------------------------------------------------------------
    def take_peer_failure(self, err: PeerFailedError) -> Incident | None:
        """The watchdog found ``err``: the incident to escalate, or ``None`` (:meth:`.FailureState.peer_failed`)."""
        escalated = self.failure.peer_failed(err)
        hooks.emit(hooks.PEER_FAILED, self.table, err, escalated is not None)
        return escalated

    def acknowledge(self, err: PeerFailedError | None = None) -> None:
        """The main thread takes a peer's failure (``err``) and raises it: no reported exit by the
        watchdog, and an orderly teardown of the (released) process groups at interpreter exit."""
        hooks.emit(hooks.ACKNOWLEDGED, self.table, err, self.failure.peer_error)
        self.failure.acknowledged(err)  # the incident err's tag names, not the current one
        hooks.emit(hooks.JOB_FAILED, self)  # the launchers: torchrun's attempt keys, before this thread raises on
        teardown_at_exit()

    # -- record ------------------------------------------------------------------------------------
    def report_error(self, exc: BaseException, *, section: str, step: int | None = None,
                     epoch: int | None = None, seq: int | None = None, release: bool = False) -> FailureRecord:
        """This rank failed with ``exc``: publish its record (before any agreement); with ``release``,
        release its collectives so that no peer blocked in one with it waits."""
        record = FailureRecord.from_exception(exc, rank=self.rank, section=section, seq=seq, step=step, epoch=epoch)
        self.failure.failed_here(record)
        tag(exc, record=record)
        hooks.emit(hooks.RANK_FAILED, record)
        log(logging.ERROR, "failed%s: %s: %s", f" in {section!r}" if seq is not None else "", record.exc_type,
            record.exc_message, step=step)
        try:
            self.schema.publish(record)
        except Exception as err:  # noqa: BLE001 - the flag still carries the rank; never mask the failure
            log(logging.WARNING, "could not publish the failure record: %s", first_line(err))
        hooks.emit(hooks.JOB_FAILED, self)  # the launchers: torchrun's attempt keys
        if release:
            what = self.release_collectives()
            log(logging.INFO, "released this rank's collectives so that no peer waits: %s", what, step=step)
        return record

    # -- agree ---------------------------------------------------------------------------------------
    def agree(self, kind: str, name: str, failure: BaseException | None = None, *, step: int | None = None,
              epoch: int | None = None, peer: PeerFailedError | None = None) -> BaseException | None:
        """One agreement over this rank's own ``failure`` or a ``peer``'s it knows. Never raises: returns
        what this rank raises for the others' failure (a :class:`PeerFailedError`, a
        :class:`SectionMismatchError`), ``None`` when none failed or it raises its own ``failure``."""
        seq = self._seq
        self._seq += 1
        self.live_seq = seq
        failed, err = False, None
        try:
            failed, err = self._agree(kind, name, seq, failure, step, epoch, peer)
            return err
        finally:
            self.live_seq = seq + 1
            # a fresh incident begins: it must stay watchful; the error is tagged with the one it
            # ends, which the main thread's acknowledge() marks
            incident = self.failure.agreement_ended(failed, err)
            if failed:
                hooks.emit(hooks.JOB_FAILED, self)  # the launchers: torchrun's attempt keys
            if err is not None:
                tag(err, incident=incident)

    def _agree(self, kind, name, seq, failure, step, epoch, peer) -> tuple[bool, BaseException | None]:
        """``(some rank failed, what this rank raises for the others)``."""
        if failure is not None:
            published = tag_of(failure).record
            if published is not None:
                self.failure.failed_here(published, told=False)
            else:
                self.report_error(failure, section=name, step=step, epoch=epoch, seq=seq)
        flag = self.rank + 1 if failure is not None else (0 if peer is None else 1 + (peer.failed_rank or 0))
        digest = zlib.crc32(f"{kind}\0{name}".encode("utf-8", "replace"))
        self._flag.copy_(torch.tensor(pack_agreement(min(flag, MAX_FLAG), digest, seq), dtype=torch.int64))
        self.agreeing = True
        try:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.side)
        except Exception as err:  # noqa: BLE001 - a peer vanished, or this rank was released
            if failure is not None:
                return True, None  # this rank raises its own exception whatever the peers did
            cause = peer or self.classify(err)
            if cause is None:
                cause = PeerFailedError(None, type(err).__name__, f"the fail-together agreement itself failed: {err}",
                                        where=f"the agreement of {name!r}", section=name)
            return True, cause
        finally:
            self.agreeing = False
        got_flag, in_step = unpack_agreement(*(int(v) for v in self._flag.tolist()))
        if got_flag == 0:
            return (False, None) if in_step else (True, self._mismatch(kind, name, seq))
        if failure is not None or peer is not None:
            self._consume(read=False)
            return True, peer
        records = self._consume(read=True)
        return True, PeerFailedError.from_records(records, fallback_rank=got_flag - 1, section=name)

    def _consume(self, *, read: bool) -> list[FailureRecord]:
        """Take the records published since the last agreement, up to one of the *next* agreement (a
        peer released before this rank may have failed in it already): returned only with ``read``."""
        try:
            count = self.schema.count()
        except Exception as err:  # noqa: BLE001
            log(logging.WARNING, "could not read failure records: %s", first_line(err))
            return []
        indices = self.schema.new_indices(self.consumed, count)
        if not indices:
            self.consumed = count  # nothing new, or a corrupted counter (warned): carry on from it
            return []
        taken: list[int] = []
        records: list[FailureRecord] = []
        for index in indices:
            record = self.schema.read(index)
            if record is not None and record.origin == "failure" and record.seq == self.live_seq + 1:
                break  # the next agreement's (no peer can be further ahead): left for it, with what follows
            taken.append(index)
            if record is not None and not self.stale(record):
                records.append(record)
        if taken:
            self.consumed = taken[-1]
            self.delivered = frozenset(sorted(self.delivered | set(taken))[-MAX_DELIVERED:])
        return records if read else []

    def stale(self, record: FailureRecord) -> bool:
        """A failure of an agreement that has ended (:attr:`live_seq`), or of an earlier attempt's process."""
        if record.origin != "failure":
            return False
        if record.seq is not None and record.seq < self.live_seq:
            return True
        return record.rank in self.table.ranks and record.pid != self.table.pid_of(record.rank)

    def peer_records(self, schema: Schema, indices) -> list[FailureRecord]:
        """The records at ``indices`` (read through ``schema``) of other ranks, late news left out."""
        return [r for r in (schema.read(i) for i in indices) if r is not None and r.rank != self.rank
                and not self.stale(r)]

    def _mismatch(self, kind: str, name: str, seq: int) -> SectionMismatchError:
        mine = f"{kind} {name!r} (agreement {seq})"
        sections = {self.rank: mine}
        with contextlib.suppress(Exception):  # the report is a nicety; the mismatch is raised anyway
            self.schema.set_section(self.rank, mine)
            deadline = time.monotonic() + MISMATCH_WAIT
            wanted = [r for r in self.ranks[:16] if r != self.rank]
            while wanted and time.monotonic() < deadline:
                for r in list(wanted):
                    text = self.schema.section_of(r)
                    if text is not None:
                        sections[r] = text
                        wanted.remove(r)
                time.sleep(0.02)
        listed = "; ".join(f"rank {r}: {sections[r]}" for r in sorted(sections))
        message = (f"the ranks met in different fail-together sections: {listed}. Every rank must enter the same "
                   "sections in the same order, like a collective")
        log(logging.ERROR, "%s", message)
        return SectionMismatchError(message, sections)

    # -- classify ------------------------------------------------------------------------------------
    def classify(self, exc: BaseException) -> PeerFailedError | None:
        """``None`` if ``exc`` is this rank's own failure, else the peer's failure behind it (for a backend
        error: the cause when one is found within :data:`EXPLAIN_WAIT`)."""
        if isinstance(exc, PeerFailedError):
            return exc
        if not _compat_torch.is_backend_error(exc):
            return None
        # this rank's own SIGTERM/SIGINT broke it (no peer to blame), else a peer's failure known or found
        return (self.failure.signal or self.failure.peer_error or self.same_host_probe.poll(time.monotonic())
                or self._explain(exc))

    def failure_report(self, wait: float) -> PeerFailedError | None:
        """What is known of a failure under way, waiting up to ``wait`` seconds for an explanation in progress."""
        if self.failure.peer_error is not None:
            return self.failure.peer_error
        explaining = self._explaining
        if explaining is None:
            return None
        done, outcome = explaining
        done.wait(wait)
        return outcome()

    def lost_ranks(self) -> dict[int, FailureRecord]:
        """Rank -> its record, for every rank this run's records declare lost or silent (``PeerLost``
        first, one whose keeper is gone first)."""
        lost: dict[int, FailureRecord] = {}
        for index in self.schema.new_indices(0, self.schema.count()):
            record = self.schema.read(index)
            if record is None or record.kind not in (FailureKind.PEER_LOST, FailureKind.PEER_SILENT):
                continue
            kept = lost.get(record.rank)
            if kept is None or (record.kind is FailureKind.PEER_LOST and not (kept.ended and kept.ended.keeper_gone)):
                lost[record.rank] = record
        return lost

    def _explain(self, exc: BaseException) -> PeerFailedError | None:
        """Why a collective broke: another rank's record, or a suspect (at the address the error names)
        whose heartbeat stopped or whose host held the store that is gone; read in a thread of its own."""
        suspects = self.table.suspects(exc)
        deadline = time.monotonic() + EXPLAIN_WAIT
        found: list[FailureRecord] = []
        done = threading.Event()
        conn = self.connection("explain", FAILURE_PATH_STORE_TIMEOUT)
        schema = Schema(conn, self.schema.world_size)
        start = self.consumed
        head = first_line(exc, None)
        detail = next(iter(re.findall(r"(Connection [a-z ]+by peer|Connection closed|Read error|Timed out)", head)),
                      "the connection broke")

        def reader() -> None:
            beats: dict[int, tuple[int, float, float]] = {}  # rank -> (value, observed still, answered at)
            try:
                while not done.is_set() and time.monotonic() < deadline:
                    try:
                        indices = schema.new_indices(start, schema.count())
                        records = self.peer_records(schema, indices)
                    except Exception:  # noqa: BLE001 - the store does not answer
                        store_hosts = {self.table.host_ids[self.ranks.index(self.store_rank)]} \
                            if self.store_rank is not None else set()  # a store on a host of its own: none
                        gone = [r for r in suspects if self.table.host_ids[self.ranks.index(r)] in store_hosts]
                        # only on evidence that the store is gone: a slow store says nothing of its host
                        evidence = self.store_evidence(EXPLAIN_EVIDENCE_TIMEOUT) if gone else None
                        if evidence is not None:
                            why = f"{detail} from its host, which holds the c10d store, and the store does not answer"
                            found.extend(self.table.lost_record(r, f"{why} ({evidence})") for r in gone)
                            break
                        time.sleep(0.1)
                        continue
                    if records:
                        found.extend(records)
                        break
                    silent = []
                    for r in suspects:
                        value = schema.heartbeat_of(r)
                        # observed silence only: a slow read (a busy store) is no evidence
                        now = time.monotonic()
                        last_value, still, answered = beats.get(r, (value, 0.0, now))
                        if value != last_value:
                            still = 0.0
                        elif now - answered <= SUSPECT_OBSERVED_GAP:
                            still += now - answered
                        beats[r] = (value, still, now)
                        if still >= SUSPECT_SILENCE:
                            silent.append(r)
                    if silent:
                        why = f"{detail} [{', '.join(addresses_named(head))}] and no heartbeat for {SUSPECT_SILENCE:.1f} s"
                        declared = [self.table.lost_record(r, why) for r in silent]
                        for record in declared:
                            if schema.claim_declaration(record.rank):
                                schema.publish(record)
                        found.extend(declared)
                        break
                    time.sleep(0.05)
            except Exception:  # noqa: BLE001 - nothing to explain with
                pass
            finally:
                done.set()

        def outcome() -> PeerFailedError | None:
            if self.failure.peer_error is not None:
                return self.failure.peer_error
            if found:
                return PeerFailedError.from_records(found)
            if suspects:
                # Alive and silent about it: not this rank's failure, and no culprit to name.
                names = ", ".join(f"rank {r} on {self.table.host_of(r)}" for r in suspects)
                return PeerFailedError(None, FailureKind.COMMUNICATION.value,
                                       f"the connection to {names} broke ({head[:300]}) and no rank reported "
                                       "why", where="a collective", origin="declared", kind=FailureKind.COMMUNICATION)
            return None

        thread = threading.Thread(target=reader, name="fth-explain", daemon=True)
        thread.start()
        self._explaining = (done, outcome)
        try:
            while time.monotonic() < deadline and not done.is_set() and self.failure.peer_error is None:
                time.sleep(0.02)
            return outcome()  # the watchdog's finding first
        finally:
            self._explaining = None
            done.set()
            # a daemon thread inside a torch call at interpreter exit aborts the process
            thread.join(timeout=FAILURE_PATH_STORE_TIMEOUT.total_seconds() + 0.5)
            conn.close()

    # -- watchdog ------------------------------------------------------------------------------------
    def start_watchdog(self, hang_timeout: timedelta | str | None = None):
        """Take a reference on this group's watchdog (started on the first)."""
        with self._lock:
            if self._watchdog is None:
                factory = hooks.provider(hooks.WATCHDOG)  # the detectors': the core knows no watchdog
                if factory is None:
                    raise RuntimeError("no watchdog is available: import fault_tolerant_handlers (its detect "
                                       "package provides it) before starting one")
                if self._left:  # it watches again: its silence and its end count again
                    self._left = False
                    try:
                        self.schema.clear_left(self.rank)
                    except Exception as err:  # noqa: BLE001 - the watchdog judges an unreachable store
                        log(logging.DEBUG, "could not clear the left mark: %s", first_line(err))
                self._watchdog = factory(self, hang_timeout=hang_timeout or self.config.hang_timeout).start()
            elif hang_timeout is not None and self._watchdog.hang_timeout != hang_timeout:
                log(logging.WARNING, "watchdog already running with hang_timeout=%s; keeping it",
                    self._watchdog.hang_timeout)
            self._watchdog_refs += 1
            return self._watchdog

    def stop_watchdog(self) -> None:
        """Drop a reference; the last one stops the watchdog (and closes its connections)."""
        with self._lock:
            self._watchdog_refs = max(0, self._watchdog_refs - 1)
            if self._watchdog_refs or self._watchdog is None:
                return
            watchdog, self._watchdog = self._watchdog, None
        self.leave()
        watchdog.stop()

    def leave(self) -> None:
        """A clean stop (not failing): mark this rank left in the store before its heartbeat stops, so that
        its peers take it for a rank that finished first, not a lost one."""
        if self.failure.failing or self._left:
            return
        conn = self.schema.conn
        held, conn.deadline = conn.deadline, time.monotonic() + LEAVE_WAIT
        try:
            self.schema.mark_left(self.rank)
            self._left = True
        except Exception as err:  # noqa: BLE001 - the store is gone: nothing is watched any more anyway
            log(logging.DEBUG, "could not mark this rank as left: %s", first_line(err))
        finally:
            conn.deadline = held

    @property
    def watchdog(self):
        return self._watchdog

    # -- lifecycle -----------------------------------------------------------------------------------
    def stop(self, *, keep_liveness: bool = False) -> None:
        """Leave the registry and stop the watchdog; with ``keep_liveness`` (recovering with spares) its
        liveness helper watches on until :meth:`abandon`."""
        with _registry_lock:
            for key in [k for k, v in _registry.items() if v is self]:
                del _registry[key]
        with self._lock:
            watchdog, self._watchdog, self._watchdog_refs = self._watchdog, None, 0
        if watchdog is not None:
            if not keep_liveness:
                self.leave()
            watchdog.stop(keep_liveness=keep_liveness)
            if keep_liveness:
                self._kept_liveness = watchdog.liveness
        if not keep_liveness and self._kept_liveness is not None:
            kept, self._kept_liveness = self._kept_liveness, None
            kept.stop()

    def abandon(self, *, shared_keys: bool) -> None:
        """Stop everything this session started and forget it (no collective): :meth:`stop`, delete this
        rank's keys of the run (``shared_keys``: the shared ones too), close the connections and destroy
        the side group. The signal handlers and exit hooks stay (once per process)."""
        if self.side is None:
            return
        self.stop()
        try:
            self.schema.remove_run_keys(self.rank, self.ranks, shared=shared_keys)
        except Exception as err:  # noqa: BLE001 - the store may be what failed
            log(logging.DEBUG, "abandoning the session: %s", first_line(err))
        hooks.emit(hooks.SESSION_CLOSED, self)  # the launchers: what they hold for this session
        self.schema.conn.close()
        side, self.side = self.side, None
        try:
            dist.destroy_process_group(side)
        except Exception as err:  # noqa: BLE001 - already destroyed (destroy_process_group() of all)
            log(logging.DEBUG, "side group: %s", err)


#: What a rank says of the store's host at the setup gather (:meth:`Session._store_here`).
STORE_ELSEWHERE, STORE_HERE, STORE_UNSEEN = 0, 1, 2


def store_rank_of(ranks: list[int], said: list[int]) -> int | None:
    """The first rank on the store's host, from what every rank ``said``; the group's first when none
    could tell; ``None`` when the store is on a host of its own."""
    for rank, here in zip(ranks, said):
        if here == STORE_HERE:
            return rank
    if all(here == STORE_UNSEEN for here in said):
        return ranks[0]
    return None


def is_local_address(address: str) -> bool:
    """``address`` (an IP) is this host's: loopback, or one a socket can bind to here."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


_registry: dict[tuple[int, int], Session] = {}
_registry_lock = threading.Lock()
_exit_hook_registered = False


def live_sessions() -> list[Session]:
    """Every session of this process that is not closed (recovering in place abandons them)."""
    with _registry_lock:
        return list(dict.fromkeys(_registry.values()))


def _forget_all() -> None:
    """At interpreter exit, stop the watchdogs and drop the side groups and store clients."""
    with _registry_lock:
        sessions = list(_registry.values())
        _registry.clear()
    for session in sessions:
        watchdog = session._watchdog
        if watchdog is not None:
            watchdog.stop(join_timeout=1.0)
    for session in sessions:
        _schema.unblock_stuck_calls(session.keep_ports, busy_too=session.failure.failing)
    sessions.clear()
    gc.collect()


def get_session(group: dist.ProcessGroup | None = None, *, caller: str = "fail_together") -> Session | None:
    """The session of ``group`` (the world when ``None``), or ``None`` with nothing to coordinate.

    Raises:
        RuntimeError: a multi-rank job before ``init_process_group``.
        ValueError: this process is not a member of ``group``; an ``FTH_*`` variable is malformed.
        RecoveryError: ``recover_in_place`` wraps the launcher that spawned this rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError(
                f"{caller}(group=...) was given a process group, but torch.distributed is not initialized; "
                "call torch.distributed.init_process_group() first")
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            world = 1
        if world > 1:
            raise RuntimeError(
                f"{caller} was called in a job of WORLD_SIZE={world} ranks before "
                "torch.distributed.init_process_group(); call it after the process group is initialized "
                "(init_process_group, idist.Parallel, or inside the Trainer's hooks)")
        return None
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(
            f"{caller}(group=...): this process (global rank {dist.get_rank()}) is not a member of the given group "
            f"(ranks {dist.get_process_group_ranks(group)}); pass a group that contains this rank, or group=None "
            "for all ranks")
    world = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if world <= 1:
        return None
    key = (id(_compat_torch.default_group()), id(group))
    session = _registry.get(key)
    if session is None:
        with _registry_lock:
            session = _registry.get(key)
            if session is None:
                parent = attempts.spawned_by_recovery()  # a rank spawned by a function recover_in_place wraps
                if parent is not None:
                    raise RecoveryError(
                        f"this rank's fail-together session ({caller}) cannot start: recover_in_place runs in the "
                        f"parent process (pid {parent}) that started this rank (idist.Parallel(nproc_per_node=...), "
                        "Lightning strategy='ddp_spawn' or 'ddp_fork', torch.multiprocessing.spawn), so a failed rank "
                        "could not be recovered in place: its process ends. Wrap the function each rank runs instead: "
                        "with idist.Parallel(...) as p: p.run(recover_in_place(training, max_restarts=N), cfg); with "
                        "Lightning, strategy='ddp' or torchrun, the script calling recover_in_place(train)(...) "
                        "around the Trainer")
                # A new default group (destroy + init) makes every older session stale.
                for stale in [k for k in _registry if k[0] != key[0]]:
                    old = _registry.pop(stale)
                    if old._watchdog is not None:
                        old._watchdog.stop()
                session = Session(group)
                global _exit_hook_registered
                if not _exit_hook_registered:  # once per process; registered after torch's own: runs before them
                    _exit_hook_registered = True
                    atexit.register(_forget_all)
                _registry[key] = session
    return session


def check_name(owner: str, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{owner}(name=...) must be a non-empty str naming the section, got {name!r}")
    return name


class Guard:
    """One training loop's use of its session, what both adapters call at their framework's hooks:
    their ``FaultTolerance`` arguments checked (``owner`` names the class in errors) and a rank that
    fails releasing its collectives at once (``release_on_failure``)."""

    #: The kinds of work (``detect.autohang``) whose report names the step under way: the next one.
    NEXT_STEP_WORK = ("start", "step")

    def __init__(self, *, sync_every: int | None = 100, hang_timeout: timedelta | float | str | dict | None = None,
                 watchdog: bool = True, release_on_failure: bool = True, name: str = "train",
                 owner: str = "FaultTolerance") -> None:
        if sync_every is not None and (isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"{owner}(sync_every=...) must be a positive int (iterations) or None, got {sync_every!r}")
        self.hang_timeout = config.check_hang_timeout(hang_timeout, what=f"{owner}(hang_timeout=...)")
        if not isinstance(watchdog, bool):
            raise TypeError(f"{owner}(watchdog=...) must be True or False, got {watchdog!r}")
        self.name = check_name(owner, name)
        config.load()  # every FTH_* variable is checked now, not when a failure comes
        self.sync_every, self.use_watchdog, self.release_on_failure = sync_every, watchdog, release_on_failure
        self.session: Session | None = None
        self._watching = False
        self._explainers: list = []

    @property
    def active(self) -> bool:
        return self.session is not None

    @property
    def auto_hang(self):  # the learned-deadline probe of hang_timeout="auto", else None
        return getattr(self.session.watchdog if self.session is not None else None, "auto_hang", None)

    def start(self) -> None:
        """Collective on first use: call on every rank before training. A no-op without distribution."""
        self.session = get_session(None, caller=type(self).__name__)
        if self.session is not None and self.use_watchdog and not self._watching:
            self.session.start_watchdog(self.hang_timeout)
            self._watching = True
        self.beat()

    def stop(self) -> None:
        """The loop ended normally on every rank: drop this loop's watchdog reference."""
        if self._watching and self.session is not None:
            auto = self.auto_hang
            if auto is not None:  # this loop's work is over: nothing of it is watched any more
                auto.mark(None, time.monotonic())
                auto.explainers[:] = [e for e in auto.explainers if e not in self._explainers]
            self._explainers = []
            self._watching = False
            self.session.stop_watchdog()

    def beat(self, step: int | None = None, work: str | None = None, *, completed: bool = False) -> None:
        """Progress; ``work``: the kind of work that begins now (``hang_timeout="auto"``); ``completed``:
        a batch completed. Raises again a hung main thread's interrupt that user code swallowed."""
        raise_pending()
        watchdog = self.session.watchdog if self.session is not None else None
        if watchdog is not None:  # a hang report names the step under way: in a training step, the next
            named = step + 1 if step is not None and work in self.NEXT_STEP_WORK else None
            watchdog.beat(step, completed=completed, named=named)
            if work is not None and watchdog.auto_hang is not None:
                watchdog.auto_hang.mark(work, time.monotonic(), step if named is None else named)

    def explain_with(self, explainer) -> None:
        """Add a way to recognise work from the main thread's stack (``detect.autohang``)."""
        auto = self.auto_hang
        if auto is not None and explainer not in auto.explainers:
            auto.explainers.append(explainer)
            self._explainers.append(explainer)

    def due(self, iteration: int) -> bool:
        return self.sync_every is not None and iteration % self.sync_every == 0

    def check(self, *, step: int | None = None, epoch: int | None = None) -> None:
        """Raise the peer failure the watchdog already knows (no communication), or the interrupt
        of a hung main thread that user code swallowed."""
        raise_pending()
        known = self.session.failure.peer_error if self.session is not None else None
        if known is not None:
            raise self.on_exception(known, step=step, epoch=epoch)

    def sync(self, where: str, *, step: int | None = None, epoch: int | None = None) -> None:
        """One agreement at sync point ``where``: raise on every rank if any rank failed."""
        if self.session is None:
            return
        self.check(step=step, epoch=epoch)
        err = self.session.agree("loop", f"{self.name}: {where}", step=step, epoch=epoch)
        if err is not None:
            tag(err, agreed=True)
            raise self.on_exception(err, step=step, epoch=epoch)

    def on_exception(self, exc: BaseException, *, step: int | None = None, epoch: int | None = None) -> BaseException:
        """What this rank must raise for ``exc`` (handled once): ``exc`` itself, a local failure now
        published, or the peer's ``PeerFailedError`` for an error that comes from a peer's failure."""
        session = self.session
        if session is None or tag_of(exc).handled:
            return exc
        if isinstance(exc, SystemExit) and session.failure.signal is not None:
            tag(exc, handled=True)  # the framework's answer to this rank's own SIGTERM: the peers know it
            return exc
        peer = session.classify(exc)
        if peer is not None:
            session.acknowledge(peer)
            tag(peer, handled=True)
            if peer is not exc:
                peer.__cause__ = exc
            log(logging.ERROR, "stopping: %s", first_line(peer, None), step=step)
            return peer
        session.report_error(exc, section=self.name, step=step, epoch=epoch, release=self.release_on_failure)
        tag(exc, handled=True)
        return exc
