"""The watchdog's probes, one at a time: a fake clock, an in-memory store (HashStore), fake pids.
No process or thread is started."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch.distributed as dist

from fault_tolerant_handlers.core.config import SILENCE_POLL
from fault_tolerant_handlers.core.procfs import PeerPidProbe, RankTable
from fault_tolerant_handlers.detect.autohang import SelfHangProbe, Unobserved, waiting_on_peers
from fault_tolerant_handlers.detect.liveness import HeartbeatProbe
from fault_tolerant_handlers.detect.watchdog import RecordsProbe, StoreLossProbe
from fault_tolerant_handlers.core.failure import Ended, FailureKind, FailureRecord
from fault_tolerant_handlers.core.schema import Connection, Schema


def schema_over(store: dist.Store, world_size: int = 4) -> Schema:
    return Schema(Connection(lambda: dist.PrefixStore("fth/test", store), timedelta(seconds=1), "test"), world_size)


def failure(rank: int, message: str = "bad sample 17") -> FailureRecord:
    try:
        raise ValueError(message)
    except ValueError as exc:
        return FailureRecord.from_exception(exc, rank=rank, section="train", step=3, epoch=1)


def test_records_probe_waits_the_grace_then_reports_another_ranks_record():
    store = dist.HashStore()
    mine, peer = schema_over(store), schema_over(store)
    probe = RecordsProbe(mine, rank=0, grace=0.3, delivered=frozenset)
    assert probe.poll(10.0) is None
    peer.publish(failure(rank=2))
    assert probe.poll(10.1) is None            # seen, but a sync point may still deliver it
    found = probe.poll(10.45)
    assert found is not None and found.failed_rank == 2 and found.exc_type == "ValueError"
    assert found.origin == "failure"  # read back from the store: nothing to declare


@pytest.mark.parametrize("kind", [FailureKind.PEER_SILENT, FailureKind.PEER_LOST])
def test_a_record_declaring_a_rank_lost_or_silent_is_reported_at_once_not_after_the_grace(kind):
    """Node-b's link cut: rank 0's liveness helper declares rank 1 silent. No sync point can deliver
    that record (an agreement needs rank 1 too), so the watchdog reports it at its first look
    instead of 0.3 s later."""
    store = dist.HashStore()
    mine, peer = schema_over(store), schema_over(store)
    probe = RecordsProbe(mine, rank=0, grace=0.3, delivered=frozenset)
    assert probe.poll(10.0) is None
    peer.publish(FailureRecord.declared(rank=1, kind=kind, message="rank 1 lost", by=0, host="node-b"))
    found = probe.poll(10.1)
    assert found is not None and found.failed_rank == 1 and found.exc_type == kind.value


def test_under_recover_in_place_a_raise_is_reported_at_once_unless_the_main_thread_is_in_an_agreement():
    """Under ``recover_in_place`` (``at_once``) a peer's raise found while this rank's main thread is
    anywhere but an agreement (in a step's collectives, which the raising rank will not join) is
    reported at the first look: every raise lost the whole 0.3 s grace before. Found while it is in
    an agreement, the agreement may still deliver it: the grace stays."""
    store = dist.HashStore()
    mine, peer = schema_over(store), schema_over(store)
    agreeing = [False]
    probe = RecordsProbe(mine, rank=0, grace=0.3, delivered=frozenset, at_once=lambda: not agreeing[0])
    assert probe.poll(10.0) is None
    peer.publish(failure(rank=2))
    found = probe.poll(10.1)
    assert found is not None and found.failed_rank == 2 and found.exc_type == "ValueError"
    agreeing[0] = True
    peer.publish(failure(rank=3))
    assert probe.poll(11.0) is None            # in an agreement: left to it for the grace
    found = probe.poll(11.35)
    assert found is not None and found.failed_rank == 3


def test_records_probe_leaves_delivered_records_and_its_own_alone():
    store = dist.HashStore()
    mine, peer = schema_over(store), schema_over(store)
    delivered = [frozenset()]
    probe = RecordsProbe(mine, rank=0, grace=0.3, delivered=lambda: delivered[0])
    peer.publish(failure(rank=1))
    assert probe.poll(1.0) is None
    delivered[0] = frozenset({1})              # an agreement delivered it to the main thread
    assert probe.poll(2.0) is None
    peer.publish(failure(rank=2))
    delivered[0] = frozenset({1, 2})           # delivered before the probe even saw it
    assert probe.poll(3.0) is None and probe.poll(4.0) is None
    mine.publish(failure(rank=0))              # this rank's own failure: not a peer's
    assert probe.poll(3.0) is None and probe.poll(4.0) is None


@pytest.mark.parametrize("corrupt", [-5, 2**62, "wrap"])
def test_a_manipulated_counter_warns_naming_the_key_and_detection_goes_on(corrupt, caplog):
    store = dist.HashStore()
    mine, peer = schema_over(store), schema_over(store)
    probe = RecordsProbe(mine, rank=0, grace=0.0, delivered=frozenset)
    value = 2**63 - 1 if corrupt == "wrap" else corrupt
    store.set("fth/test/n", str(value))
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert probe.poll(1.0) is None
    assert "store key n moved from 0" in caplog.text
    peer.publish(failure(rank=3))              # the next add wraps past 2**63-1 in the "wrap" case
    found = probe.poll(2.0)
    assert found is not None and found.failed_rank == 3


def test_a_garbage_counter_is_repaired_and_a_record_still_found(caplog):
    store = dist.HashStore()
    mine, peer = schema_over(store), schema_over(store)
    probe = RecordsProbe(mine, rank=0, grace=0.0, delivered=frozenset)
    peer.publish(failure(rank=1))
    assert probe.poll(1.0) is not None
    store.set("fth/test/n", "abc")
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert probe.poll(2.0) is None
    assert "store key n held a non-integer value" in caplog.text
    assert int(store.get("fth/test/n")) == 1
    peer.publish(failure(rank=2))
    assert probe.poll(3.0).failed_rank == 2


def test_an_out_of_range_record_is_ignored_naming_its_key(caplog):
    store = dist.HashStore()
    mine, peer = schema_over(store, world_size=2), schema_over(store, world_size=2)
    probe = RecordsProbe(mine, rank=0, grace=0.0, delivered=frozenset)
    peer.publish(failure(rank=1))
    store.set("fth/test/r/1", store.get("fth/test/r/1").replace(b'"rank":1', b'"rank":1000000000000000000000000000000'))
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert probe.poll(1.0) is None
    assert "r/1" in caplog.text and "outside [0, 1]" in caplog.text


def test_heartbeat_probe_declares_a_silent_successor_after_the_limit():
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=5.0)
    other.beat(1)
    assert probe.poll(0.0) is None              # first look: value 1
    assert probe.poll(0.2) is None              # not due yet
    other.beat(1)
    assert probe.poll(1.0) is None              # moved
    for k in range(1, 10):
        assert probe.poll(1.0 + 0.5 * k) is None  # still for up to 4.5 s
    assert probe.poll(6.0) is None              # 5.0 s: not past the limit
    found = probe.poll(6.5)
    assert found is not None and found.exc_type == "PeerSilent" and found.failed_rank == 1
    assert "no heartbeat for 5.5 s" in found.exc_message and found.record.by == 0
    assert int(store.get("fth/test/hb/0")) == 13  # its own heartbeat went on, once a poll


def _table(rank: int, hosts: tuple[str, ...]) -> RankTable:
    n = len(hosts)
    return RankTable(rank, tuple(range(n)), tuple(100 + r for r in range(n)), hosts)


def test_the_last_rank_before_another_host_watches_every_rank_of_that_host():
    """3 hosts x 2 ranks: a host cut off whole silences its second rank's only watcher (its first
    rank, cut off with it); the last rank of the host before it watches both, so both are named."""
    hosts = ("a", "a", "b", "b", "c", "c")
    assert [_table(r, hosts).watched() for r in range(6)] == [[1], [2, 3], [3], [4, 5], [5], [0, 1]]
    assert _table(0, ("a", "b")).watched() == [1] and _table(1, ("a", "b")).watched() == [0]
    assert _table(0, ("a", "a")).watched() == [1]  # one host: its ring successor only
    assert _table(0, ("a",)).watched() == []
    # ranks placed round-robin: each rank watches the other host's ranks (more watchers, none missing)
    assert [_table(r, ("a", "b", "a", "b")).watched() for r in range(4)] == [[1, 3], [2, 0], [3, 1], [0, 2]]


def test_only_the_probe_that_beats_moves_this_rank_s_heartbeat():
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    first = HeartbeatProbe(mine, rank=1, successor=2, successor_pid=42, period=0.5, limit=3.0)
    second = HeartbeatProbe(mine, rank=1, successor=3, successor_pid=43, period=0.5, limit=3.0, beats=False)
    other.beat(2), other.beat(3)
    for k in range(10):
        first.poll(0.5 * k), second.poll(0.5 * k)
        other.beat(2)  # rank 3 stands still
    assert int(store.get("fth/test/hb/1")) == 10
    assert second.poll(5.0).failed_rank == 3


def test_heartbeat_probe_counts_no_silence_while_its_own_calls_are_slow():
    """A gap between two answered polls (this rank's own store calls failed or took long: the store
    or the machine is busy, and the successor's beats are late for the same reason) is no evidence."""
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=3.0)
    other.beat(1)
    assert probe.poll(0.0) is None
    assert probe.poll(0.5) is None              # 0.5 s observed
    assert probe.poll(10.0) is None             # 9.5 s without an answer in between: not counted
    assert probe.poll(10.5) is None and probe.poll(11.0) is None and probe.poll(11.5) is None  # 2.0 s
    assert probe.poll(12.0) is None             # 2.5 s
    assert probe.poll(12.5) is None             # 3.0 s: not past the limit
    found = probe.poll(13.0)
    assert found is not None and "no heartbeat for 3.5 s" in found.exc_message


def _drive(probe: HeartbeatProbe, beats_until: float, end: float, beat=None) -> float | None:
    """The liveness loop over a fake clock (0.01 s ticks): the probe polled whenever it is due, the
    watched rank beating every 0.5 s from 0.05 s until ``beats_until``. The time of the declaration."""
    for tick in range(int(end * 100)):
        now = tick / 100
        if 0.05 <= now <= beats_until and tick % 50 == 5:
            beat()
        if now >= probe.due():
            found = probe.poll(now)
            if found is not None:
                return now
    return None


def test_a_silence_is_counted_from_within_a_tenth_of_a_second_of_its_last_beat_and_declared_just_past_the_limit():
    """A cut link: the watched rank's last beat lands just after a read. Read only every period, its
    silence was counted from the next read (up to 0.5 s after the beat) and declared at the first read
    past the limit (up to 0.5 s after it): here 2.45 s after the last beat for a 2 s limit. Read every
    SILENCE_POLL from a little before each beat is due until it moves: between the limit and the limit
    + 0.2 s after the last beat; this rank's own beats keep their period meanwhile; a healthy rank's
    counter costs at most two reads a period, and is never declared; a running rank on this host
    (never declared while it runs) is read once a period."""
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=2.0)
    reads = []
    read = mine.heartbeat_of
    mine.heartbeat_of = lambda r: reads.append(r) or read(r)
    declared = _drive(probe, beats_until=5.1, end=10.0, beat=lambda: other.beat(1))  # the last beat at 5.05 s
    assert declared is not None and 5.05 + 2.0 < declared <= 5.05 + 2.0 + 2 * SILENCE_POLL + 0.01, declared
    assert int(store.get("fth/test/hb/0")) == int(declared / 0.5) + 1  # its own beats: every 0.5 s from 0
    healthy = HeartbeatProbe(mine, rank=2, successor=1, successor_pid=4242, period=0.5, limit=2.0)
    reads.clear()
    assert _drive(healthy, beats_until=60.0, end=60.0, beat=lambda: other.beat(1)) is None
    assert len(reads) <= 2 * 60 / 0.5 + 6, len(reads)  # and a period of reads every 0.1 s to find its beat
    # on this host and running (its death is the pid probe's): read once a period, as before
    same_host = HeartbeatProbe(mine, rank=2, successor=1, successor_pid=4242, period=0.5, limit=2.0,
                               running=lambda: True)
    reads.clear()
    assert _drive(same_host, beats_until=1.1, end=30.0, beat=lambda: other.beat(1)) is None
    assert len(reads) <= 30 / 0.5 + 1, len(reads)


def test_heartbeat_probe_never_declares_a_successor_that_never_beat():
    probe = HeartbeatProbe(schema_over(dist.HashStore()), rank=0, successor=1, successor_pid=1, period=0.5, limit=1.0)
    assert all(probe.poll(t) is None for t in (0.0, 1.0, 5.0, 50.0))


def test_pid_probe_names_the_signal():
    states = {11: None, 12: Ended(signal=9)}
    probe = PeerPidProbe([(1, 11), (2, 12)], by=0, host="node-a", state=states.get)
    found = probe.poll(0.0)
    assert found.failed_rank == 2 and found.exc_type == "PeerLost"
    assert found.exc_message == "rank 2 (pid 12 on node-a) lost: killed by SIGKILL"
    assert found.kind is FailureKind.PEER_LOST and found.ended == Ended(signal=9)
    assert found.record.ended == Ended(signal=9)
    states[12] = None
    assert probe.poll(1.0) is None
    states[12] = Ended(exit_code=0)
    assert probe.poll(2.0) is None  # a clean exit is no failure
    failed = [True]  # once the job failed, only a killed peer is news
    probe = PeerPidProbe([(2, 12)], by=0, host="node-a", state=states.get, after_failure=lambda: failed[0])
    states[12] = Ended(exit_code=1)
    assert probe.poll(3.0) is None
    states[12] = Ended(signal=9)
    assert probe.poll(4.0).ended.killed


def _frame_in(filename: str):
    code = compile("import sys\nframe = sys._getframe()", filename, "exec")
    scope: dict = {}
    exec(code, scope)
    return scope["frame"]


def test_self_hang_probe_reports_the_main_thread_stack_and_spares_a_rank_waiting_on_peers():
    progress = [(100.0, 1_700_000_000.0, 7)]
    frame = [_frame_in("/x/train.py")]
    probe = SelfHangProbe(1, 4242, 5.0, margin=2.0, progress=lambda: progress[0], frame=lambda: frame[0])
    assert probe.poll(104.0) is None
    found = probe.poll(105.5)
    assert found.kind is FailureKind.RANK_HUNG and found.exc_type == "RankHung" and found.failed_rank == 1
    assert "no progress for 5.5 s at step 7" in found.exc_message
    assert "/x/train.py" in found.remote_traceback
    frame[0] = _frame_in("/site-packages/torch/distributed/distributed_c10d.py")
    assert waiting_on_peers(frame[0])
    assert probe.poll(105.5) is None            # blocked in a collective: the peer is the hung one
    assert probe.poll(112.5).kind is FailureKind.RANK_HUNG  # ... unless it stays blocked past 2 x timeout + margin


def test_self_hang_probe_leaves_out_the_time_the_watchdog_could_not_look():
    unobserved = Unobserved()
    progress = [(100.0, 1_700_000_000.0, 7)]
    probe = SelfHangProbe(1, 4242, 5.0, margin=2.0, progress=lambda: progress[0],
                          frame=lambda: _frame_in("/x/train.py"), unobserved=unobserved)
    assert probe.poll(101.0) is None
    unobserved.waited(30.1, 0.1)                # the process stopped for 30 s (its wait of 0.1 s took 30.1)
    unobserved.waited(0.09, 0.1)                # on time, or late within 3 periods (scheduling): nothing
    unobserved.waited(0.29, 0.1)
    assert probe.poll(131.5) is None            # 1.5 s observed
    assert probe.poll(134.9) is None
    found = probe.poll(135.2)                   # 5.2 s observed: hung
    assert found is not None and "no progress for 5.2 s at step 7" in found.exc_message


def test_a_rank_released_from_a_hung_peers_collective_is_not_hung_while_it_handles_the_failure():
    """4 ranks, rank 2 hung at step 16: the others wait in the DDP all_reduce from their last beat
    until rank 2's failure releases them 5.1 s later, and handle it (the DataLoader's workers shut
    down, the recovery begins) without a beat. The wait is not held against them: the stall counts
    from the last poll that saw it (one of them named itself hung 0.1 s after its release)."""
    progress = [(100.0, 1_700_000_000.0, 16)]
    waiting, handling = _frame_in("/site-packages/torch/autograd/graph.py"), _frame_in("/x/torch/utils/data/dataloader.py")
    frame = [waiting]
    probe = SelfHangProbe(1, 4242, 5.0, margin=2.0, progress=lambda: progress[0], frame=lambda: frame[0])
    for now in (100.1, 102.0, 104.0, 105.0):    # every poll looks, before hang_timeout too
        assert probe.poll(now) is None
    frame[0] = handling                         # released at 105.1
    assert probe.poll(105.2) is None            # 5.2 s from its last beat, 0.2 s from its wait
    assert probe.poll(109.9) is None
    found = probe.poll(110.1)                   # stuck outside any wait for hang_timeout: hung after all
    assert found.kind is FailureKind.RANK_HUNG and "no progress for 10.1 s at step 16" in found.exc_message
    progress[0] = (111.0, 1_700_000_011.0, 17)  # a beat: a wait before it counts for nothing after it
    assert probe.poll(115.9) is None
    assert probe.poll(116.1).kind is FailureKind.RANK_HUNG


def test_store_loss_probe_declares_the_store_host_after_the_silence_with_evidence():
    probe = StoreLossProbe(10.0, by=1, store_pid=99, evidence=lambda: "a TCP connect to h:1: refused")
    assert probe.failed(0.0, ConnectionError("refused")) is True
    assert probe.failed(5.0, ConnectionError("refused")) is False
    assert probe.poll(9.0) is None
    probe.answered()
    assert probe.poll(20.0) is None
    probe.failed(20.0, ConnectionError("refused"))
    assert probe.poll(20.0) is None  # one check only
    found = probe.poll(30.5)
    assert found.failed_rank == 0 and found.exc_type == "PeerLost"
    assert "hosts the c10d store" in found.exc_message and "ConnectionError: refused" in found.exc_message
    assert "a TCP connect to h:1: refused" in found.exc_message


def test_the_loss_of_a_store_on_a_host_of_its_own_names_no_rank():
    probe = StoreLossProbe(4.0, by=1, store_rank=None, store_at="10.231.0.254:29400",
                           evidence=lambda: "a TCP connect to 10.231.0.254:29400: refused")
    probe.failed(0.0, ConnectionError("refused"))
    probe.poll(0.0)
    found = probe.poll(4.5)
    assert found.failed_rank is None and found.kind.value == "StoreLost"
    assert found.exc_message.startswith("the c10d store at 10.231.0.254:29400, on a host of no rank's, is lost: "
                                              "the store has not answered for 4.5 s"), found.exc_message


def test_the_store_s_address_is_read_from_this_process_s_connection_to_it():
    """``procfs.store_peer_address``: the address a client's connection to the store reaches (what
    the session matches against the ranks' addresses to tell on which rank's host the store runs)."""
    from fault_tolerant_handlers.core.procfs import normalize_address, store_peer_address

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert normalize_address(store_peer_address({server.port})) == "127.0.0.1"  # its client to its own server
    assert store_peer_address({1}) is None


def test_a_slow_store_is_never_declared_lost():
    """Calls that time out while the store's port answers a plain connect (a busy store server on a
    loaded machine): no declaration, however long it lasts."""
    probe = StoreLossProbe(4.0, by=1, store_pid=99, evidence=lambda: None)
    now = 0.0
    while now < 60.0:
        probe.failed(now, TimeoutError("a store call did not return within 1.5 s"))
        assert probe.poll(now) is None
        now += 0.1
    probe.failed(now, TimeoutError("a store call did not return within 1.5 s"))
    assert probe.declare_at() is not None  # a silence is under way ...
    assert probe.poll(now + 100.0) is None  # ... and its port answers: never a loss


def test_a_slow_store_is_checked_less_and_less_often():
    """Every check is a connection the store's server accepts and names by a reverse DNS lookup in
    its only thread: a slow store checked by every rank after each failed call (10 times a second)
    was kept slow by the checks. After a port that answered, the next check waits twice as long,
    up to MAX_CHECK_HOLD; an answered call makes the next silence checked at once again."""
    from fault_tolerant_handlers.core.config import MAX_CHECK_HOLD

    checks = []
    probe = StoreLossProbe(4.0, by=1, store_pid=99, evidence=lambda: checks.append(now), check_every=0.5)
    now = 0.0
    while now < 60.0:
        probe.failed(now, TimeoutError("a store call did not return within 1.5 s"))
        assert probe.poll(now) is None
        now = round(now + 0.1, 1)
    gaps = [b - a for a, b in zip(checks, checks[1:])]
    assert gaps[:3] == pytest.approx([0.5, 1.0, 2.0])
    assert all(gap == pytest.approx(MAX_CHECK_HOLD) for gap in gaps[2:])
    assert len(checks) <= 60 / MAX_CHECK_HOLD + 2
    probe.answered()  # the store is back: a new silence is checked at once
    probe.failed(now, TimeoutError("slow"))
    probe.poll(now)
    assert checks[-1] == now


def test_store_evidence_must_hold_the_whole_silence():
    answers = iter(["refused", None] + ["refused"] * 100)
    probe = StoreLossProbe(4.0, by=1, store_pid=99, evidence=lambda: next(answers), check_every=0.5)
    probe.failed(0.0, TimeoutError("slow"))
    assert probe.poll(0.0) is None     # refused once ...
    assert probe.poll(0.5) is None     # ... then the port answered: the silence is over
    assert probe.declare_at() is None
    probe.failed(1.0, TimeoutError("slow"))
    for t in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5):
        assert probe.poll(t) is None   # evidence from 1.0 on, but not yet 4 s of it
    assert probe.poll(5.0).exc_type == "PeerLost"


def test_the_store_host_never_declares_its_own_store_lost():
    probe = StoreLossProbe(1.0, by=0, store_pid=99, evidence=lambda: "refused", hosted_here=True)
    probe.failed(0.0, TimeoutError("slow"))
    assert probe.declare_at() is None
    assert all(probe.poll(t) is None for t in (0.0, 0.5, 1.0, 5.0, 50.0))


def test_store_evidence_of_a_real_port():
    """A listening port answers (no evidence, however slow its server: nobody accepts here); a
    closed one is refused."""
    import socket

    from fault_tolerant_handlers.core.schema import store_evidence

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # never accepted: the kernel completes the handshake anyway
    port = server.getsockname()[1]
    try:
        assert store_evidence("127.0.0.1", port, 1.0) is None
    finally:
        server.close()
    found = store_evidence("127.0.0.1", port, 1.0)
    assert found is not None and "refused" in found


def test_records_probe_leaves_late_news_of_a_failure_already_agreed_on():
    # rank 2 failed in agreement 3, which this rank left (released) before rank 2 published: this
    # rank is at agreement 4 now, and every rank has already raised for that failure
    store = dist.HashStore()
    mine, peer = schema_over(store), schema_over(store)
    probe = RecordsProbe(mine, rank=0, grace=0.3, delivered=frozenset,
                         stale=lambda r: r.seq is not None and r.seq < 4)
    probe.poll(10.0)
    late = failure(rank=2)
    peer.publish(FailureRecord(**{**late.__dict__, "seq": 3}))
    assert probe.poll(10.1) is None and probe.poll(10.5) is None
    peer.publish(FailureRecord(**{**late.__dict__, "rank": 3, "seq": 4}))  # a failure in the live agreement
    probe.poll(10.6)
    found = probe.poll(11.0)
    assert found is not None and found.failed_rank == 3


def test_the_process_hosting_the_store_knows_it():
    """``procfs.listens_here``: true in the process whose TCPStore server listens on the port (rank
    0 under env:// rendezvous), false for a client of the same store."""
    import subprocess
    import sys

    from fault_tolerant_handlers.core.procfs import listens_here

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert listens_here(server.port)
    client = subprocess.run(
        [sys.executable, "-c", "import sys, torch.distributed as dist; from fault_tolerant_handlers.core.procfs import "
         f"listens_here; c = dist.TCPStore('127.0.0.1', {server.port}, is_master=False); "
         f"print(listens_here({server.port}))"], capture_output=True, text=True, timeout=60)
    assert client.stdout.strip() == "False", client.stderr[-2000:]


def test_heartbeat_probe_never_declares_a_running_successor_on_its_own_host():
    """A successor on this host whose process runs (not stopped, not gone) is only late with its
    beats (its helper's store connection is slow): no declaration. Stopped (SIGSTOP), it is silent."""
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    state = {"running": True}
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=1.0,
                           running=lambda: state["running"])
    other.beat(1)
    assert all(probe.poll(0.5 * k) is None for k in range(20))  # 9.5 s still, and it runs
    state["running"] = False
    found = probe.poll(10.0)
    assert found is not None and found.exc_type == "PeerSilent"


def test_a_live_rank_half_way_to_the_heartbeat_limit_is_warned_about_once_and_not_declared(caplog):
    """A loaded machine or a lossy link: a heartbeat that stands still for half the limit, then
    moves again, leaves a warning naming the rank and the setting (the margin shown before it is
    gone), never a declaration; a second such silence warns again."""
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=2.0, host="node-b")
    other.beat(1)
    with caplog.at_level(logging.INFO, logger="fault_tolerant_handlers"):
        assert probe.poll(0.0) is None
        assert probe.poll(0.5) is None and probe.poll(1.0) is None  # 0.5, 1.0 s still
        assert probe.poll(1.5) is None and probe.poll(2.0) is None  # 1.5, 2.0 s: at the limit, not past it
        other.beat(1)
        assert probe.poll(2.5) is None
        for k in range(1, 4):
            assert probe.poll(2.5 + 0.5 * k) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "rank 1's heartbeat (pid 4242 on node-b) has stood still for 1.0 s" in warnings[0]
    assert "FTH_HEARTBEAT_TIMEOUT_SEC" in warnings[0]
    assert any("moves again after 2.0 s" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_a_running_same_host_rank_s_late_heartbeat_is_no_near_miss(caplog):
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=2.0, running=lambda: True)
    other.beat(1)
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert all(probe.poll(0.5 * k) is None for k in range(12))
    assert not caplog.records


def test_a_rank_that_left_cleanly_is_neither_warned_about_nor_declared_until_it_watches_again(caplog):
    """Rank 1 finished first: it marked itself left, then its heartbeat stopped. Its watcher never
    warns or declares it, however long it is still; once it watches again (its mark cleared, its
    counter moving) and then falls silent without leaving, it is declared."""
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=2.0, host="node-b")
    other.beat(1)
    other.mark_left(1)
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert all(probe.poll(0.5 * k) is None for k in range(20))  # 9.5 s still
    assert not caplog.records
    other.clear_left(1)
    other.beat(1)
    assert probe.poll(10.0) is None  # moved: watched again
    found = [probe.poll(10.0 + 0.5 * k) for k in range(1, 7)]
    assert found[-1] is not None and found[-1].exc_type == "PeerSilent", found


def test_pid_probe_does_not_declare_a_peer_gone_after_it_left_cleanly():
    """Under torchrun the agent reaps a rank at once: a rank that exited cleanly is only 'gone'. Left
    marked (it stopped its watchdog cleanly first), it is no failure and is no longer watched; a
    peer gone without the mark is declared, as before, and so is a left peer whose exit status
    shows a failure."""
    left = {1}
    asked = []

    def has_left(rank: int) -> bool:
        asked.append(rank)
        return rank in left

    states = {11: Ended(), 12: None}
    probe = PeerPidProbe([(1, 11), (2, 12)], by=0, host="node-a", state=states.get, left=has_left)
    assert probe.poll(0.0) is None and probe.peers == [(2, 12)]
    assert probe.poll(1.0) is None and asked == [1]  # asked once: not watched any more
    states[12] = Ended()
    found = probe.poll(2.0)
    assert found is not None and found.failed_rank == 2
    assert "process is gone" in found.exc_message
    # a status that shows a failure is declared, left mark or not (sys.exit(1) under mp.spawn)
    for how, text in ((Ended(exit_code=1), "exited with code 1"), (Ended(signal=9), "killed by SIGKILL")):
        probe = PeerPidProbe([(1, 11)], by=0, host="node-a", state={11: how}.get, left=lambda rank: True)
        found = probe.poll(3.0)
        assert found is not None and text in found.exc_message, found


def test_the_watchdog_publishes_the_record_a_probe_declared_once_and_nothing_read_back():
    """A probe's finding is the error itself: its record is published (first declarer only) when the
    probe declared it and the watchdog was given where; a record read back from the store, or a
    declaration with nowhere to go (the store is what is gone), is not published."""
    from fault_tolerant_handlers.core.failure import PeerFailedError
    from fault_tolerant_handlers.detect.watchdog import Watchdog

    store = dist.HashStore()
    mine, peer = schema_over(store), schema_over(store)
    silent = PeerPidProbe([(2, 12)], by=0, host="node-a", state={12: Ended(signal=9)}.get).poll(0.0)
    watchdog = Watchdog.__new__(Watchdog)
    watchdog._declare(silent, None)  # nowhere to publish
    assert mine.count() == 0
    watchdog._declare(silent, mine)
    watchdog._declare(silent, peer)  # a second declaration of the same rank: claimed already
    assert mine.count() == 1 and mine.read(1) == silent.record
    watchdog._declare(PeerFailedError.from_records([failure(rank=3)]), mine)  # read back: not declared here
    assert mine.count() == 1


class _FakeLink:
    """A :class:`~fault_tolerant_handlers.detect.witness.Link` whose host acknowledges while ``up``."""

    def __init__(self) -> None:
        self.up, self.readied, self.sent, self.unacked_since = True, 0, [], None

    def ready(self, now: float) -> None:
        self.readied += 1

    def send(self, now: float) -> None:
        self.sent.append(now)
        if not self.up and self.unacked_since is None:
            self.unacked_since = now

    def unacked_for(self, now: float) -> float:
        return 0.0 if self.up or self.unacked_since is None else now - self.unacked_since


def test_a_cut_link_is_declared_once_its_host_acknowledges_nothing_and_a_slow_live_host_only_at_the_limit():
    """A rank on another host, its last beat at 5.05 s. Its link cut just after: nothing sent to its
    host is acknowledged, so it is declared once it has been still for SUSPECT_SILENCE (1.2 s) and the
    bytes waited FTH_UNACKED_SEC (1 s), well before the 2 s limit, naming both witnesses. Its host
    acknowledging every byte (its process starved or frozen, the machine loaded), it is declared only
    past the 2 s limit, as without the witness; and a healthy rank is never declared."""
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    cut = _FakeLink()
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=2.0, host="node-b",
                           link=cut, unacked_after=1.0)

    def beat(last: bool) -> None:
        other.beat(1)
        cut.up = not last  # the link goes down right after the last beat

    found = []
    for tick in range(1000):
        now = tick / 100
        if tick % 50 == 5 and now <= 5.1:
            beat(last=tick == 505)
        if now >= probe.due():
            result = probe.poll(now)
            if result is not None:
                found.append((now, result))
                break
    assert cut.readied >= 1 and found, cut.sent
    at, result = found[0]
    assert 5.05 + 1.2 <= at <= 5.05 + 1.2 + 0.1 + 0.01, at  # the 2 s limit: 7.05 s and later
    assert result.exc_type == "PeerSilent" and result.failed_rank == 1
    assert "acknowledged nothing sent to it for 1." in result.exc_message
    assert "(pid 4242 on node-b)" in result.exc_message

    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    slow = _FakeLink()  # up all along: the host answers, only the process is late
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=2.0, link=slow,
                           unacked_after=1.0)
    declared = _drive(probe, beats_until=5.1, end=10.0, beat=lambda: other.beat(1))
    assert declared is not None and 5.05 + 2.0 < declared <= 5.05 + 2.0 + 2 * SILENCE_POLL + 0.01, declared
    healthy = HeartbeatProbe(mine, rank=2, successor=1, successor_pid=4242, period=0.5, limit=2.0,
                             link=_FakeLink(), unacked_after=1.0)
    assert _drive(healthy, beats_until=60.0, end=60.0, beat=lambda: other.beat(1)) is None


def test_the_witness_never_shortens_the_silence_below_suspect_silence():
    """Nothing acknowledged for long (a link that broke before the counter stood still) but the
    heartbeat still for less than SUSPECT_SILENCE: not declared yet."""
    store = dist.HashStore()
    mine, other = schema_over(store), schema_over(store)
    link = _FakeLink()
    link.up, link.unacked_since = False, -100.0
    probe = HeartbeatProbe(mine, rank=0, successor=1, successor_pid=4242, period=0.5, limit=2.0, link=link,
                           unacked_after=1.0)
    other.beat(1)
    assert probe.poll(0.0) is None
    assert all(probe.poll(0.1 * k) is None for k in range(1, 12))  # 1.1 s still
    assert probe.poll(1.25) is not None
