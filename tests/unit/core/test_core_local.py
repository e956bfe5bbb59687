"""Single-process behaviour: no process group means no cost and no change; records are bounded
and hostile records are ignored; errors are clear. (Branch tests; the distributed behaviour is
proven by the multi-process tests.)"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pickle
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fault_tolerant_handlers import PeerFailedError, fail_together, one_rank_first
from fault_tolerant_handlers.core import config
from fault_tolerant_handlers.core import session as session_mod
from fault_tolerant_handlers.core.failure import (Ended, FailureKind, FailureRecord, MAX_RECORD_BYTES, MAX_TRACEBACK_CHARS)
from fault_tolerant_handlers.core.procfs import RankTable


def test_without_distribution_sections_are_plain(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not dist.is_initialized()
    ran = []
    with fail_together("x"):
        ran.append(1)
    with one_rank_first():
        ran.append(2)
    with one_rank_first(local=True):
        ran.append(3)
    assert ran == [1, 2, 3]
    err = ValueError("unchanged")
    with pytest.raises(ValueError) as info:
        with fail_together("x"):
            raise err
    assert info.value is err
    with pytest.raises(KeyError):
        with one_rank_first():
            raise KeyError("k")
    # a reported error is raised at the end of the section, as on a multi-rank job
    with pytest.raises(FileNotFoundError):
        with fail_together("x") as section:
            section.report_error(FileNotFoundError("f"))


def test_before_init_on_a_multi_rank_job_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 .*init_process_group"):
        with fail_together("x"):
            pass
    with pytest.raises(RuntimeError, match="one_rank_first"):
        with one_rank_first():
            pass


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"rank": 1}, ValueError, r"rank must be in \[0, 0\]"),
        ({"rank": 1}, ValueError, "rank should be between 0 and 0, but given 1"),  # Ignite's own text
        ({"rank": -1}, ValueError, "rank should be between 0 and 0, but given -1"),
        ({"rank": "0"}, TypeError, r"one_rank_first\(rank=\.\.\.\) must be an int"),
        ({"rank": False}, TypeError, "must be an int"),
        ({"local": "yes"}, TypeError, r"local=\.\.\.\) must be True or False"),
    ],
)
def test_one_rank_first_rejects_bad_arguments(monkeypatch, kwargs, exc, match):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(exc, match=match):
        with one_rank_first(**kwargs):
            pass


def test_single_rank_process_group_creates_no_side_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    try:
        from torch.distributed import distributed_c10d

        groups_before = len(distributed_c10d._world.pg_map)
        with fail_together("x"):
            pass
        with one_rank_first():
            pass
        assert len(distributed_c10d._world.pg_map) == groups_before
        assert not session_mod._registry
    finally:
        dist.destroy_process_group()


NOW_MS = int(time.time() * 1000)


def _record(**over):
    try:
        raise ValueError("bad sample 17")
    except ValueError as exc:
        rec = FailureRecord.from_exception(exc, rank=1, section="load data", seq=0, step=5, epoch=2)
    if "time_ms" in over and over["time_ms"] < 10**9:
        over["time_ms"] += NOW_MS
    return FailureRecord(**{**rec.__dict__, **over})


def test_record_round_trip_and_caps():
    rec = _record()
    back = FailureRecord.from_json(rec.to_json(), world_size=4)
    assert back == rec
    data = FailureRecord.from_exception(ValueError("m" * 100_000), rank=0, section="s", seq=0).to_json()
    assert len(data) < MAX_RECORD_BYTES
    assert len(FailureRecord.from_json(data, world_size=4).exc_message) <= 2_000
    # the traceback keeps its tail: the frames nearest the raise
    long_tb = FailureRecord.from_json(json.dumps({**json.loads(rec.to_json()), "traceback": "a" * 9_000 + "TAIL"}), world_size=4)
    assert long_tb.traceback.endswith("TAIL") and len(long_tb.traceback) <= MAX_TRACEBACK_CHARS


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x04\x95pickle",  # a pickle is never loaded
        b"not json",
        b"[1, 2]",
        json.dumps({"v": 99}).encode(),
        json.dumps({"v": 2, "rank": "0"}).encode(),
        b"{" + b" " * (MAX_RECORD_BYTES + 1) + b"}",
    ],
)
def test_malformed_or_oversized_records_are_ignored_with_a_warning(payload, caplog):
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        assert FailureRecord.from_json(payload, world_size=4, key="r/7") is None
    assert "ignoring store key r/7" in caplog.text


def test_peer_failed_error_message_attributes_and_pickle():
    a = _record(rank=1, time_ms=1000)
    b = _record(rank=3, time_ms=1001, exc_type="KeyError", exc_message="'x'")
    err = PeerFailedError.from_records([b, a])
    assert err.failed_rank == 1 and err.exc_type == "ValueError" and err.exc_message == "bad sample 17"
    assert err.where == "'load data' (epoch 2, iteration 5)"
    assert str(err).startswith("rank 1 failed in 'load data' (epoch 2, iteration 5): ValueError: bad sample 17")
    assert "also failed: rank 3: KeyError: 'x'" in str(err)
    assert "raise ValueError" in str(err)  # the remote traceback follows
    assert err.others == [{"rank": 3, "exc_type": "KeyError", "exc_message": "'x'"}]
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, PeerFailedError) and str(again) == str(err) and again.failed_rank == 1
    # ties on the timestamp go to the lowest rank
    assert PeerFailedError.from_records([_record(rank=3, time_ms=5), _record(rank=2, time_ms=5)]).failed_rank == 2


def test_sync_timeout_env_is_validated(monkeypatch):
    monkeypatch.setenv(config.SYNC_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="FTH_SYNC_TIMEOUT_SEC='soon'"):
        config.load().sync_timeout
    monkeypatch.setenv(config.SYNC_TIMEOUT_ENV, "-3")
    with pytest.raises(ValueError, match="from 1 to 2592000"):
        config.load().sync_timeout
    monkeypatch.setenv(config.SYNC_TIMEOUT_ENV, "90")
    assert config.load().sync_timeout == timedelta(seconds=90)


def test_a_rank_that_failed_and_was_also_declared_is_named_once_with_its_own_failure():
    cause = _record(rank=1, time_ms=1000, exc_type="KeyError", exc_message="'first1'")
    second = _record(rank=2, time_ms=1300, exc_type="IndexError", exc_message="second2")
    declared = _record(rank=2, time_ms=1200, exc_type="PeerSilent", exc_message="rank 2 silent", origin="declared")
    again = _record(rank=1, time_ms=1400, exc_type="PeerLost", exc_message="rank 1 lost", origin="declared")
    err = PeerFailedError.from_records([again, declared, second, cause, second])
    assert err.failed_rank == 1 and err.exc_type == "KeyError"
    assert err.others == [{"rank": 2, "exc_type": "IndexError", "exc_message": "second2"}]


def test_a_signal_a_rank_declared_itself_comes_before_the_keyboard_interrupt_it_became():
    signalled = _record(rank=1, time_ms=1000, exc_type="RankSignalled", exc_message="rank 1 received SIGINT",
                        origin="declared", by=1)
    interrupt = _record(rank=1, time_ms=1100, exc_type="KeyboardInterrupt", exc_message="")
    err = PeerFailedError.from_records([interrupt, signalled])
    assert err.failed_rank == 1 and err.exc_type == "RankSignalled" and err.others == []


@pytest.mark.parametrize(
    "ranks, failed, in_step",
    [
        ([(0, 7, 3), (0, 7, 3), (0, 7, 3)], 0, True),  # everybody in the same section and agreement
        ([(0, 7, 3), (0, 9, 3)], 0, False),  # different sections
        ([(0, 7, 3), (0, 7, 4)], 0, False),  # the same section, one agreement apart
        ([(0, 7, 3), (0, 7, 3 + (1 << 20))], 0, True),  # kept to 20 bits: 2**20 agreements apart is not seen
        ([(0, 2**32 - 1, 5), (0, 0, 5)], 0, False),  # hashes at both ends of their range
        ([(0, 7, 3), (2, 9, 4), (0, 7, 3)], 2, None),  # a failure: its flag, whatever the sections
    ],
)
def test_the_two_integer_agreement_carries_the_flag_and_catches_ranks_out_of_step(ranks, failed, in_step):
    from fault_tolerant_handlers.core.session import pack_agreement, unpack_agreement

    packed = [pack_agreement(*r) for r in ranks]
    flag, same = unpack_agreement(max(p[0] for p in packed), max(p[1] for p in packed))
    assert flag == failed
    if in_step is not None:
        assert same is in_step


def _consuming_session(store: dist.Store, live_seq: int) -> session_mod.Session:
    """The parts of a session that taking records uses, over a HashStore (no process group)."""
    from fault_tolerant_handlers.core.schema import Connection, Schema

    s = session_mod.Session.__new__(session_mod.Session)
    s.schema = Schema(Connection(lambda: dist.PrefixStore("fth/t", store), timedelta(seconds=1), "main"), 4)
    s.consumed, s.delivered, s.live_seq = 0, frozenset(), live_seq
    s.table = RankTable(0, (0, 1, 2, 3), (os.getpid(),) * 4, ("h",) * 4)  # every record here is this process's
    return s


_clock = itertools.count(int(time.time() * 1000))


def _failure(rank: int, seq: int, message: str) -> FailureRecord:
    """A record of a failure that happened after every record made before it (its own millisecond:
    records made within one would sort by rank, and the order these tests describe would be lost)."""
    try:
        raise KeyError(message)
    except KeyError as exc:
        record = FailureRecord.from_exception(exc, rank=rank, section="two", seq=seq)
    return dataclasses.replace(record, time_ms=next(_clock))


def test_a_failure_of_the_next_agreement_is_left_for_it():
    """Agreement 3 ends; a peer released first fails at once in agreement 4 and publishes before
    this rank takes agreement 3's records: agreement 3 names rank 1, agreement 4 names rank 2."""
    store = dist.HashStore()
    s = _consuming_session(store, live_seq=3)
    publisher = _consuming_session(store, live_seq=3).schema
    publisher.publish(_failure(1, 3, "first1"))
    publisher.publish(_failure(2, 3, "second2"))
    publisher.publish(_failure(2, 4, "first2"))  # the next agreement's
    got = s._consume(read=True)
    assert [(r.rank, r.seq) for r in got] == [(1, 3), (2, 3)]
    assert s.consumed == 2 and s.delivered == {1, 2}
    s.live_seq = 4
    publisher.publish(_failure(1, 4, "second1"))
    got = s._consume(read=False)  # this rank failed itself in agreement 4: the records are still taken
    assert s.consumed == 4 and s.delivered == {1, 2, 3, 4} and got == []
    s.consumed, s.delivered = 2, frozenset({1, 2})
    got = s._consume(read=True)
    assert [(r.rank, r.exc_message) for r in got] == [(2, "'first2'"), (1, "'second1'")]
    assert PeerFailedError.from_records(got).failed_rank == 2


def test_a_failed_session_s_liveness_helper_beats_on_until_the_session_is_abandoned():
    """Recovering in place stops a failed session with ``keep_liveness``: its watchdog's threads stop
    at once, its liveness helper only when the session is abandoned (the teardown), so a rank that
    goes silent a poll after the failure (a host cut off whole: its second rank) is still declared."""
    import threading

    calls = []

    class Liveness:
        def stop(self):
            calls.append("liveness stopped")

    class Watchdog:
        liveness = Liveness()

        def stop(self, join_timeout=None, *, keep_liveness=False):
            calls.append(f"watchdog stopped, keep_liveness={keep_liveness}")
            if not keep_liveness:
                self.liveness.stop()

    s = session_mod.Session.__new__(session_mod.Session)
    s._lock, s._watchdog, s._watchdog_refs, s._kept_liveness = threading.Lock(), Watchdog(), 1, None
    s.stop(keep_liveness=True)
    assert calls == ["watchdog stopped, keep_liveness=True"]
    s.stop()  # what abandon() does first
    assert calls == ["watchdog stopped, keep_liveness=True", "liveness stopped"]
    s.stop()
    assert calls.count("liveness stopped") == 1


def test_every_rank_names_the_same_store_rank_from_what_each_said_of_its_host():
    """At setup each rank tells whether the store is on its host (its connection to the store leads
    to a loopback address or one of its own, or it hosts the store); the first such rank is the
    store's rank on every rank; none: the store is on a host of its own (no rank is blamed for its
    loss); nobody could tell (no TCP store seen): the group's first, as the launchers lay it out."""
    here, elsewhere, unseen = session_mod.STORE_HERE, session_mod.STORE_ELSEWHERE, session_mod.STORE_UNSEEN
    assert session_mod.store_rank_of([0, 1, 2, 3], [elsewhere, elsewhere, here, here]) == 2
    assert session_mod.store_rank_of([0, 1], [elsewhere, elsewhere]) is None
    assert session_mod.store_rank_of([0, 1], [unseen, unseen]) == 0
    assert session_mod.store_rank_of([4, 6], [unseen, elsewhere]) is None
    assert session_mod.is_local_address("127.0.0.1") and session_mod.is_local_address("::1")
    assert not session_mod.is_local_address("192.0.2.7")  # TEST-NET-1: no host's own
    assert not session_mod.is_local_address("node-a")  # a name is never looked up


def test_a_record_that_says_the_keeper_is_gone_is_the_one_kept_for_its_rank():
    """The same death declared twice: by a same-host peer's pid check (no word of the keeper) and by
    the rank's liveness helper (its keeper gone too). The recovery must see the second."""
    s = _consuming_session(dist.HashStore(), 0)
    peer = FailureRecord.lost(rank=1, pid=7, host="node-b", why=Ended(signal=9), by=2)
    helper = FailureRecord.lost(rank=1, pid=7, host="node-b", why=Ended(signal=9, keeper_gone=True), by=1)
    silent = FailureRecord.declared(rank=1, kind=FailureKind.PEER_SILENT, message="no heartbeat", by=0)
    for record in (silent, helper, peer):
        s.schema.publish(record)
    assert s.lost_ranks()[1].ended == Ended(signal=9, keeper_gone=True)
