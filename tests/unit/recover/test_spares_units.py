"""Spares, branch by branch, over a real (in-process) c10d store: the argument, which launched ranks
train, what a training rank's environment says, which spare replaces a lost rank (every survivor
learns the same), what a spare is told, and rank 0's decision when a rank is lost with no keeper. The
recoveries themselves run on real ranks in ``tests/distributed/test_spares.py``."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch.distributed as dist

from fault_tolerant_handlers import RecoveryError, recover_in_place, spares_left
from fault_tolerant_handlers.recover import spares
from fault_tolerant_handlers.core import config
from fault_tolerant_handlers.core.failure import Ended, FailureKind, FailureRecord, PeerFailedError
from fault_tolerant_handlers.core.schema import keeper_key
from fault_tolerant_handlers.recover.agree import NOT_IN_PLACE, cause_of
from fault_tolerant_handlers.recover.inplace import _Recovery
from fault_tolerant_handlers.recover.spares import Answer, Layout, Order, Seat

TORCHRUN = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}


@pytest.fixture(autouse=True)
def forget_spares_left(monkeypatch):
    monkeypatch.setattr(spares, "_left", None)  # what this process learned: each test's own


@pytest.fixture
def torchrun_env(monkeypatch):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


# -- the argument ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, -5])
def test_a_negative_number_of_spares_is_refused_at_the_call_naming_the_valid_range(bad):
    with pytest.raises(ValueError, match=rf"recover_in_place\(spares=\.\.\.\) must be an int from 0 to the launched "
                                         rf"world size - 1 \(0: no spares\), got {bad}"):
        recover_in_place(print, spares=bad)


@pytest.mark.parametrize("bad", [True, 1.0, "1", None])
def test_spares_that_is_not_an_int_is_refused_naming_what_it_accepts(bad):
    with pytest.raises(TypeError, match=r"spares=\.\.\.\) must be an int from 0 to the launched world size - 1"):
        recover_in_place(print, spares=bad)


@pytest.mark.parametrize("bad", [3, 4])
def test_spares_that_leave_no_training_rank_are_refused_when_the_launched_world_is_known(bad, torchrun_env):
    with pytest.raises(ValueError, match=rf"recover_in_place\(spares={bad}\): the job was launched with 3 ranks "
                                         r"\(WORLD_SIZE=3\), so spares must be from 0 to 2 \(at least 1 rank trains\)"):
        recover_in_place(print, spares=bad)()


def test_spares_need_torchrun_s_store(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(RecoveryError, match=r"spares=1\) needs torchrun"):
        recover_in_place(print, spares=1)()


def test_spares_after_init_process_group_are_refused_naming_why(torchrun_env):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RecoveryError, match=r"spares=1\) must be called before init_process_group"):
            recover_in_place(print, spares=1)()
    finally:
        dist.destroy_process_group()


# -- which ranks train -------------------------------------------------------------------------------
def test_the_last_launched_ranks_are_the_spares():
    lay = Layout(launched_world=6, spares=2, launched_rank=3)
    assert lay.training_world == 4 and not lay.is_spare
    assert Layout(6, 2, 4).is_spare and Layout(6, 2, 5).is_spare
    assert [lay.spare_rank(taken) for taken in (1, 2)] == [4, 5]


@pytest.mark.parametrize("world, rank, local_rank, local_world, spares_count, expected", [
    (3, 0, 0, 3, 1, 2),  # one host of 3 with 1 spare: 2 train there
    (6, 1, 1, 2, 2, 2),  # 3 hosts x 2, the last host's 2 ranks spares: hosts 0 and 1 train with 2 each
    (6, 4, 0, 2, 2, 0),  # ... and the spare host has none
    (4, 2, 0, 2, 1, 1),  # 2 hosts x 2, 1 spare: the second host trains with 1
])
def test_a_training_rank_s_local_world_counts_the_training_ranks_of_its_host(world, rank, local_rank, local_world,
                                                                            spares_count, expected):
    assert Layout(world, spares_count, rank, local_rank, local_world).training_local_world() == expected


def test_a_training_rank_s_environment_names_the_training_world(torchrun_env):
    lay = spares.layout(1)
    assert (lay.launched_world, lay.training_world, lay.is_spare) == (3, 2, False)
    spares.enter_training_world(lay)
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"]) == ("0", "2", "2")
    assert spares_left() == 1


# -- which spare replaces a lost rank -------------------------------------------------------------------
def test_the_first_survivor_claims_the_next_spare_and_every_survivor_learns_the_same():
    store, lay = dist.HashStore(), Layout(4, 2, 0)
    store.set(spares.seat_key(1), Seat(1, "host-b").to_json())
    wait = timedelta(seconds=5)
    got = []
    later = threading.Thread(target=lambda: got.append(spares.claim(store, lay, 1, 0, "rank 1 failed", 12.5, wait)))
    first = spares.claim(store, lay, 1, 0, "rank 1 failed", 12.5, wait)
    later.start()
    later.join(10)
    assert first == got[0] == Answer(2, 1)  # launched rank 2, the first spare; one left after it
    order = Order.from_json(store.get(spares.order_key(2)), lay.training_world)
    assert order == Order(spares.TAKE, "rank 1 failed", 1, 0, 12.5, 1, "launched rank 1 on host host-b",
                          lost_host="host-b")
    assert not store.check([spares.order_key(3)])
    assert spares_left() == 1
    # the next loss takes the next spare, the one after finds none
    assert spares.claim(store, lay, 0, 1, "rank 0 failed", 0.0, wait) == Answer(3, 0)
    assert spares.claim(store, lay, 1, 2, "rank 1 failed", 0.0, wait) == Answer(-1, 0)
    assert spares_left() == 0


def test_a_waiting_spare_is_told_to_take_a_rank_or_that_the_job_ended(monkeypatch):
    monkeypatch.setenv(config.SPARE_WAIT_ENV, "1")
    store, lay = dist.HashStore(), Layout(3, 1, 2)
    threading.Timer(0.2, lambda: spares.tell_end(store, lay, True, "the training ended")).start()
    order = spares.wait_for_order(store, lay, 2)  # across a wait that times out: no order lost
    assert (order.kind, order.ok, order.why) == (spares.END, True, "the training ended")
    spares.tell_end(store, lay, False, "rank 0 failed")
    assert all(not spares.wait_for_order(store, lay, launched).ok for launched in range(3))  # a lost keeper too


def test_a_spare_on_the_lost_rank_s_host_takes_its_local_names_and_elsewhere_keeps_its_own(torchrun_env):
    import os

    from fault_tolerant_handlers.core.failure import host_name

    lay = Layout(3, 1, 2, 2, 3)
    torchrun_env.setenv("LOCAL_RANK", "2")
    spares.take_seat(lay, Order(spares.TAKE, "", 1, 0, lost_host="elsewhere", lost_local_rank=1, lost_local_world=2))
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "2")
    spares.take_seat(lay, Order(spares.TAKE, "", 1, 0, lost_host=host_name(), lost_local_rank=1, lost_local_world=2))
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("1", "2")


@pytest.mark.parametrize("raw", [b"not json", b'{"kind": "take", "why": "", "rank": 2, "attempt": 0}',
                                 b'{"kind": "take", "why": "", "rank": -1, "attempt": 0}',
                                 b'{"kind": "take", "why": "", "rank": 0, "attempt": -1}',
                                 b'{"kind": "reboot", "why": ""}', b"{" + b" " * 9000 + b"}"])
def test_an_order_read_from_the_store_is_bounded_and_checked(raw):
    assert Order.from_json(raw, world_size=2) is None


def test_an_answer_and_a_seat_read_from_the_store_are_checked():
    assert Answer.from_json(b'{"spare": 3, "left": 0}', 3) is None
    assert Answer.from_json(b'{"spare": -1, "left": 0}', 3) == Answer(-1, 0)
    assert Seat.from_json(b'{"launched": 5, "host": "a"}', 3) is None
    assert Seat.from_json(b'{"launched": 1, "host": "a\\u0000b"}', 3).launched == 1


@pytest.mark.parametrize("bad", ["0", "0.5", "abc", "4000"])
def test_the_spare_s_wait_variable_is_checked(bad, monkeypatch):
    monkeypatch.setenv("FTH_SPARE_WAIT_SEC", bad)
    with pytest.raises(ValueError, match=r"FTH_SPARE_WAIT_SEC=.*expected a number of seconds from 1 to 3600"):
        config.settings()


# -- rank 0's decision when a rank is lost with no keeper ---------------------------------------------------
KILLED = FailureRecord.declared(rank=1, kind=FailureKind.PEER_LOST, message="rank 1 (pid 7 on a) lost: killed by SIGKILL",
                                by=0)


def _declared(rank: int, kind: FailureKind, message: str) -> FailureRecord:
    """Rank ``rank`` lost or silent, as a peer tells it when it is not recovered in place as such."""
    return replace(FailureRecord.declared(rank=rank, kind=kind, message=message, by=1 - rank),
                   not_in_place=NOT_IN_PLACE[kind])


def _survivor(spares_count: int) -> _Recovery:
    recovery = _Recovery(print, 3, timedelta(seconds=30), spares=spares_count)
    recovery.layout = Layout(2 + spares_count, spares_count, 0)
    return recovery


def _spare_already_in(keeper_announced: bool = True) -> dist.HashStore:
    """The store as rank 0 finds it at the recovery: the spare ordered to rank 1's seat is already in
    (its cause written, counted as arrived); ``keeper_announced``: rank 1's keeper had set its key when
    rank 1 started, and nobody took it back."""
    store = dist.HashStore()
    if keeper_announced:
        store.set(keeper_key(1), "1")
    spare = FailureRecord.replaced(1, "rank 1's process was lost with no keeper to replace it: spare launched rank 2 took its place")
    store.set("fth/recover/0/0/cause/1", spare.to_json())
    store.add("fth/recover/0/0/arrived", 1)
    return store


def test_a_rank_lost_with_no_keeper_is_recovered_when_a_spare_comes_in_its_place():
    store = _spare_already_in(keeper_announced=False)
    decision = _survivor(1)._agree((store, 0, 2, "gloo", timedelta(seconds=30)), KILLED)
    assert decision.restart and decision.why.startswith("rank 1 failed: RankReplaced"), decision
    assert Order.from_json(store.get(spares.order_key(2)), 2).rank == 1


def test_a_rank_lost_with_no_spare_left_ends_the_job_at_once_naming_why():
    store = dist.HashStore()
    store.add(spares.taken_key(), 1)  # the only spare was taken before
    decision = _survivor(1)._agree((store, 0, 2, "gloo", timedelta(seconds=30)), KILLED)
    assert not decision.restart
    assert decision.why == ("rank 1 was lost with no keeper to replace it, and no spare is left (spares=1, all "
                            "taken): a relaunch replaces it")


def test_without_spares_a_rank_lost_with_no_keeper_ends_the_job_as_before():
    decision = _survivor(0)._agree((dist.HashStore(), 0, 2, "gloo", timedelta(seconds=30)), KILLED)
    assert not decision.restart and decision.why.startswith("a rank was lost")


# -- a rank on another host: its keeper key is left behind when its host goes -------------------------------
#: rank 0's view of rank 1 lost with its host: its end not seen (no helper told how its process ended)
HOST_GONE = _declared(1, FailureKind.PEER_LOST, "rank 1 (pid 9 on node-b) lost: Read error [10.231.0.2] and no "
                     "heartbeat for 1.2 s")


def test_a_rank_lost_with_its_host_is_replaced_by_a_spare_though_its_keeper_had_announced_itself():
    """node-b died whole: its keeper had set rank 1's keeper key when rank 1 started, and nobody took it
    back. The key is no evidence of a keeper that lives: the spare is ordered in, and the job recovers."""
    store = _spare_already_in()
    decision = _survivor(1)._agree((store, 0, 2, "gloo", timedelta(seconds=30)), HOST_GONE)
    assert decision.restart, decision
    assert Order.from_json(store.get(spares.order_key(2)), 2).rank == 1


def test_a_killed_rank_whose_keeper_lives_waits_for_its_keeper_and_no_spare_is_ordered():
    """Rank 1's process was killed on a host that lives (its end seen: ``KILLED``) and its keeper key is
    set: the keeper's replacement comes; no spare is spent."""
    store = dist.HashStore()
    store.set(keeper_key(1), "1")
    replacement = FailureRecord.replaced(1, "the process of rank 1 (pid 7) killed by SIGKILL: replaced in place")
    store.set("fth/recover/0/0/cause/1", replacement.to_json())  # its keeper's replacement is already in
    store.add("fth/recover/0/0/arrived", 1)
    decision = _survivor(1)._agree((store, 0, 2, "gloo", timedelta(seconds=30)), KILLED)
    assert decision.restart, decision
    assert not store.check([spares.order_key(2)]) and not store.check([spares.taken_key()])


def _keeper_gone_too() -> FailureRecord:
    """Rank 0's view of rank 1 killed (SIGKILL, its end seen by its liveness helper) after its keeper
    died: the helper saw the keeper gone (``Ended.keeper_gone``)."""
    err = PeerFailedError(1, "PeerLost", "rank 1 (pid 7 on node-b) lost: killed by SIGKILL, and its keeper is gone "
                          "too", origin="declared", ended=Ended(signal=9, keeper_gone=True))
    return cause_of(err, 0)


def test_a_killed_rank_whose_keeper_is_gone_too_gets_a_spare_though_its_keeper_key_is_set():
    """The keeper was killed first (its child dies with it): its key, set when the rank started, is
    left behind. The helper's word that the keeper is gone outranks the key: a spare is ordered in, and
    nobody waits the join timeout for a replacement that never comes."""
    cause = _keeper_gone_too()
    assert cause.not_in_place == NOT_IN_PLACE[FailureKind.PEER_LOST]  # no keeper replaces it
    store = _spare_already_in()
    decision = _survivor(1)._agree((store, 0, 2, "gloo", timedelta(seconds=30)), cause)
    assert decision.restart, decision
    assert Order.from_json(store.get(spares.order_key(2)), 2).rank == 1


class _Records:
    """A failed session's records, as ``Session.lost_ranks`` gives them."""

    def __init__(self, lost):
        self.lost = lost

    def lost_ranks(self):
        return dict(self.lost)


def test_a_killed_rank_whose_keeper_the_records_say_is_gone_gets_a_spare_though_the_cause_does_not_say_so():
    """The cause came from a same-host peer's record of the death (no word of the keeper), the rank's
    liveness helper's record says its keeper is gone too: the records win over the keeper key."""
    store = _spare_already_in()
    survivor = _survivor(1)
    survivor._sessions = [_Records({1: FailureRecord.lost(rank=1, pid=7, host="node-b", by=1,
                                                          why=Ended(signal=9, keeper_gone=True))})]
    decision = survivor._agree((store, 0, 2, "gloo", timedelta(seconds=30)), KILLED)
    assert decision.restart, decision
    assert store.check([spares.order_key(2)]), "no spare was ordered in"
    assert Order.from_json(store.get(spares.order_key(2)), 2).rank == 1


def test_without_spares_a_killed_rank_whose_keeper_is_gone_ends_the_job_at_once():
    store = dist.HashStore()
    store.set(keeper_key(1), "1")
    decision = _survivor(0)._agree((store, 0, 2, "gloo", timedelta(seconds=30)), _keeper_gone_too())
    assert not decision.restart and decision.why.startswith("a rank was lost"), decision


# -- a rank cut off from its peers: replaced by a spare, and it never rejoins ------------------------------
#: rank 0's view of rank 1 whose link went down: silent, its end not seen
LINK_CUT = _declared(1, FailureKind.PEER_SILENT, "rank 1 (pid 9 on node-b) lost: no heartbeat for 3.0 s (its host or "
                    "link is down, or its process is gone or frozen)")


def test_a_silent_rank_on_another_host_is_replaced_by_a_spare():
    store = _spare_already_in()
    decision = _survivor(1)._agree((store, 0, 2, "gloo", timedelta(seconds=30)), LINK_CUT)
    assert decision.restart, decision
    assert Order.from_json(store.get(spares.order_key(2)), 2).rank == 1


def test_without_spares_a_silent_rank_ends_the_job_as_before():
    decision = _survivor(0)._agree((dist.HashStore(), 0, 2, "gloo", timedelta(seconds=30)), LINK_CUT)
    assert not decision.restart and decision.why.startswith("a rank went silent"), decision


def _displaced_rank_1() -> _Recovery:
    recovery = _Recovery(print, 3, timedelta(seconds=30), spares=1)
    recovery.layout = Layout(3, 1, 1)  # launched rank 1: training rank 1
    return recovery


#: what the cut-off rank 1 knows when it comes back: rank 0 (the store's host) went silent
STORE_HOST_SILENT = _declared(0, FailureKind.PEER_SILENT, "rank 0 lost: no heartbeat for 3.0 s")


@pytest.mark.parametrize("taken", ["ordered", "seated"])
def test_a_rank_whose_place_a_spare_took_never_rejoins_and_counts_nothing(taken):
    """Rank 1 was declared lost (cut off, frozen) and spare launched rank 2 was ordered to its place (or
    already sits in it); rank 1's process comes back and reaches the recovery: it ends naming why,
    writes no cause, claims no spare and is not counted in."""
    store = dist.HashStore()
    if taken == "ordered":
        store.set(spares.answer_key(0, 1), Answer(2, 0).to_json())
    else:
        store.set(spares.seat_key(1), Seat(2, "node-c").to_json())
    decision = _displaced_rank_1()._agree((store, 1, 2, "gloo", timedelta(seconds=30)), STORE_HOST_SILENT)
    assert not decision.restart
    where = ("spare launched rank 2 takes its place" if taken == "ordered"
             else "launched rank 2 on host node-c holds its seat")
    assert decision.why == (f"rank 1 was declared lost by its peers and {where}: this process (launched rank 1) does "
                            "not rejoin the job"), decision
    assert not store.check(["fth/recover/0/0/cause/1", "fth/recover/0/0/arrived", spares.taken_key()])


def test_a_rank_in_its_own_seat_takes_part_in_the_recovery():
    store = dist.HashStore()
    store.set(spares.seat_key(1), Seat(1, "node-b").to_json())
    store.set("fth/recover/0/0/decision", '{"restart": true, "why": "rank 1 failed: x"}')
    raised = FailureRecord(1, "ValueError", "x", "", "", int(time.time() * 1000), step=5, own=True)
    _displaced_rank_1()._agree((store, 1, 2, "gloo", timedelta(seconds=30)), raised)
    assert store.check(["fth/recover/0/0/cause/1"]) and store.add("fth/recover/0/0/arrived", 0) == 1
