"""Recovering in place, branch by branch: the arguments, what a rank says of a failure, and rank 0's
decision over a real (in-process) c10d store. The recoveries themselves are proven on real ranks in
``tests/distributed/test_recover_in_place.py``."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fault_tolerant_handlers import PeerFailedError, SectionMismatchError, recover_in_place
from fault_tolerant_handlers.core.config import RECOVER_TELL_SEC
from fault_tolerant_handlers.core.failure import Ended, FailureKind, FailureRecord
from fault_tolerant_handlers.recover import agree
from fault_tolerant_handlers.recover.agree import Decision, cause_of
from fault_tolerant_handlers.recover.inplace import _Recovery
from fault_tolerant_handlers.recover.live_state import LivePlan, LiveReport, plan_live


def test_bad_arguments_are_named_with_what_is_accepted():
    with pytest.raises(ValueError, match=r"max_restarts=\.\.\.\) must be an int >= 0 .* got -1"):
        recover_in_place(print, max_restarts=-1)
    with pytest.raises(ValueError, match="got True"):
        recover_in_place(print, max_restarts=True)
    with pytest.raises(ValueError, match="between 1 and 86400 seconds"):
        recover_in_place(print, join_timeout=timedelta(0))
    with pytest.raises(TypeError, match="fn must be the training function"):
        recover_in_place(42)


@pytest.mark.parametrize("value, expected", [
    (5, timedelta(seconds=5)),
    (2.5, timedelta(seconds=2.5)),
    ("00:00:02:00", timedelta(minutes=2)),
    ("01:00:00:00", timedelta(days=1)),
    ({"minutes": 2}, timedelta(minutes=2)),
    ({"hours": 1, "seconds": 30}, timedelta(hours=1, seconds=30)),
    (timedelta(seconds=90), timedelta(seconds=90)),
    (None, timedelta(seconds=60)),
])
def test_join_timeout_takes_the_forms_of_hang_timeout(value, expected, monkeypatch):
    monkeypatch.delenv("FTH_RECOVER_JOIN_SEC", raising=False)
    assert recover_in_place(print, join_timeout=value).join_timeout == expected
    assert recover_in_place(join_timeout=value)(print).join_timeout == expected  # as a decorator


def test_join_timeout_none_is_the_variable_s(monkeypatch):
    monkeypatch.setenv("FTH_RECOVER_JOIN_SEC", "7")
    assert recover_in_place(print).join_timeout == timedelta(seconds=7)
    assert recover_in_place(print, join_timeout=3).join_timeout == timedelta(seconds=3)  # the argument wins


@pytest.mark.parametrize("bad", ["auto", " Auto "])
def test_join_timeout_has_no_auto(bad):
    with pytest.raises(ValueError) as err:
        recover_in_place(print, join_timeout=bad)  # at the call, not at a recovery
    text = str(err.value)
    assert text.startswith("recover_in_place(join_timeout=...) has no 'auto'") and text.endswith(f"got {bad!r}")
    for form in ("None (FTH_RECOVER_JOIN_SEC, else 60 s)", "datetime.timedelta", "a number of seconds",
                 "'DD:HH:MM:SS'", "a dict of timedelta arguments"):
        assert form in text, text
    with pytest.raises(ValueError, match="has no 'auto'"):
        recover_in_place(join_timeout=bad)  # the decorator form too, before any function is given


@pytest.mark.parametrize("bad", ["5m", "5:00", "00:00:05:xx", {}, {"minute": 5}, [60], b"60", True, object()])
def test_join_timeout_refuses_other_forms_naming_the_valid_ones(bad):
    with pytest.raises(TypeError) as err:
        recover_in_place(print, join_timeout=bad)
    text = str(err.value)
    assert text.startswith("recover_in_place(join_timeout=...) must be None (FTH_RECOVER_JOIN_SEC, else 60 s), ")
    assert text.endswith(f"got {bad!r}") and "'auto'" not in text


@pytest.mark.parametrize("bad", [0, 0.5, -3, 86401, float("nan"), float("inf"), "02:00:00:00", {"days": 2},
                                 timedelta(seconds=0.5)])
def test_join_timeout_out_of_range(bad):
    with pytest.raises(ValueError, match=r"^recover_in_place\(join_timeout=\.\.\.\) must be between 1 and 86400 seconds"):
        recover_in_place(print, join_timeout=bad)


def test_the_variable_is_checked_too(monkeypatch):
    monkeypatch.setenv("FTH_RECOVER_JOIN_SEC", "soon")
    with pytest.raises(ValueError, match="FTH_RECOVER_JOIN_SEC='soon': expected a number of seconds"):
        recover_in_place(print)


def test_a_single_process_returns_what_fn_returns_and_raises_what_it_raises():
    assert recover_in_place(lambda x: x + 1)(1) == 2
    with pytest.raises(ZeroDivisionError):  # no process group: nothing to recover with, raised as it is
        recover_in_place(lambda: 1 / 0, max_restarts=3)()


def peer(kind="ValueError", origin="failure", step=7) -> PeerFailedError:
    return PeerFailedError(1, kind, "boom", "tb", "'train' (iteration 7)", section="train", step=step, origin=origin)


def test_what_a_rank_says_of_its_failure():
    own = cause_of(ValueError("bad batch"), 0)
    assert (own.rank, own.exc_type, own.step, own.own, own.not_in_place) == (0, "ValueError", None, True, "")
    seen = cause_of(peer(), 0)
    assert (seen.rank, seen.exc_type, seen.step, seen.own, seen.not_in_place) == (1, "ValueError", 7, False, "")
    assert (seen.where, own.where) == ("train", "")  # the section it failed in (none: outside any)
    assert "a rank was lost" in cause_of(peer("PeerLost", "declared"), 0).not_in_place  # its host or store: gone
    killed = PeerFailedError(1, "PeerLost", "rank 1 (pid 7 on a) lost: killed by SIGKILL", origin="declared",
                             ended=Ended(signal=9))
    assert cause_of(killed, 0).not_in_place == ""  # its process ended: its keeper may replace it (checked in _agree)
    assert "silent" in cause_of(peer("PeerSilent", "declared"), 0).not_in_place
    assert "signal" in cause_of(peer("RankSignalled", "declared"), 0).not_in_place
    assert cause_of(peer("RankHung", "declared"), 0).not_in_place == ""  # interrupted: recovered
    assert "KeyboardInterrupt ends the job" in cause_of(KeyboardInterrupt(), 0).not_in_place
    assert "out of step" in cause_of(SectionMismatchError("x"), 0).not_in_place


def test_a_cause_read_from_the_store_is_bounded_and_checked():
    good = failure(step=5)
    assert FailureRecord.from_json(good.to_json(), world_size=2) == good
    assert FailureRecord.from_json(good.to_json(), world_size=1) is None  # rank out of range
    for wrong in ({"step": -1}, {"own": 1}, {"origin": "declared", "exc_type": "Forged", "by": 0}, {"rank": True},
                  {"rank": None}, {"not_in_place": 7}):
        assert FailureRecord.from_json(json.dumps(json.loads(good.to_json()) | wrong), world_size=2) is None, wrong
    assert FailureRecord.from_json(b"x" * 20000, world_size=2) is None
    assert FailureRecord.from_json(b"\x80not json", world_size=2) is None
    assert FailureRecord.from_json(json.dumps({"rank": 0}).encode(), world_size=2) is None
    loud = json.loads(good.to_json()) | {"exc_message": "\x1b[31m" + "z" * 5000}
    read = FailureRecord.from_json(json.dumps(loud).encode(), world_size=2)
    assert "\x1b" not in read.message and len(read.message) <= 2000
    # a failure no rank is to blame for names no rank (a broken collective): read back as it is
    broken = cause_of(PeerFailedError(None, "CommunicationError", "the connection broke", origin="declared"), 0)
    assert FailureRecord.from_json(broken.to_json(), world_size=2) == broken
    assert Decision.from_json(b"[1, 2]", 2) is None
    told = Decision(True, "rank 1 failed", spares_left=2)
    assert Decision.from_json(told.to_json(), 2) == told
    for wrong in (-5, 2**40, "x"):  # a count of spares left out of range is not believed
        assert Decision.from_json(json.dumps(json.loads(told.to_json()) | {"spares_left": wrong}).encode(), 2) is None


def decide(store, causes: list[FailureRecord], *, world=2, gen=0, max_restarts=3, history=(), seconds=0.2) -> Decision:
    """Rank 0's decision once rank ``i`` wrote ``causes[i]``."""
    prefix = f"fth/recover/0/{gen}/"
    for by, cause in enumerate(causes):
        store.set(f"{prefix}cause/{by}", cause.to_json())
        if cause.not_in_place:
            store.add(f"{prefix}stop", 1)
        store.add(f"{prefix}arrived", 1)
    return agree.decide(store, world, gen, seconds, max_restarts, list(history))


def failure(by=1, step=37, not_in_place="") -> FailureRecord:
    """Rank 1's ValueError, as rank ``by`` tells it."""
    return FailureRecord(1, "ValueError", "bad", "", "train", int(time.time() * 1000), step=step, own=by == 1,
                         not_in_place=not_in_place)


def test_rank_0_recovers_when_every_rank_is_in_and_names_the_failing_rank():
    decision = decide(dist.HashStore(), [failure(0), failure(1)])
    assert decision.restart and decision.why == "rank 1 failed in train: ValueError: bad"


def test_rank_0_ends_the_job_when_a_rank_does_not_come():
    decision = decide(dist.HashStore(), [failure(0)], seconds=0.2)
    assert not decision.restart and decision.why.startswith("only 1 of 2 ranks reached the recovery within 0.2 s")


def test_a_lost_rank_ends_the_job_at_once():
    decision = decide(dist.HashStore(), [failure(0, not_in_place="a rank was lost (...)")], seconds=30)
    assert not decision.restart and decision.why.startswith("a rank was lost")


def test_max_restarts_and_a_repeat_end_the_job():
    assert decide(dist.HashStore(), [failure(0), failure(1)], gen=2, max_restarts=2).why.startswith("max_restarts=2")
    repeat = decide(dist.HashStore(), [failure(0), failure(1)], gen=1, history=[failure(1)])
    assert not repeat.restart and "repeats at the same iteration" in repeat.why
    moved_on = decide(dist.HashStore(), [failure(0, step=45), failure(1, step=45)], gen=1, history=[failure(1)])
    assert moved_on.restart


def test_with_max_restarts_spent_a_rank_ends_at_once_without_waiting_for_rank_0(monkeypatch):
    from fault_tolerant_handlers.core import attempts

    monkeypatch.setattr(attempts, "_in_place", 2)
    store = dist.HashStore()
    recovery = _Recovery(print, 2, timedelta(seconds=30))
    decision = recovery._agree((store, 1, 2, "gloo", timedelta(seconds=30)), failure(1))
    assert not decision.restart and decision.why == "max_restarts=2 recoveries in place already spent"
    assert store.add("fth/recover/0/2/stop", 0) == 1  # rank 0 learns it too, without waiting for anyone


def test_a_killed_peer_is_waited_for_only_when_it_has_a_keeper():
    killed = FailureRecord.declared(rank=1, kind=FailureKind.PEER_LOST, message="rank 1 (pid 7 on a) lost: killed by SIGKILL",
                                    by=0)
    recovery = _Recovery(print, 3, timedelta(seconds=30))
    alone = dist.HashStore()
    decision = recovery._agree((alone, 0, 2, "gloo", timedelta(seconds=30)), killed)
    assert not decision.restart and decision.why.startswith("a rank was lost")
    kept = dist.HashStore()
    kept.set("fth/recover/0/keeper/1", "1")
    replacement = FailureRecord.replaced(1, "the process of rank 1 (pid 7) killed by SIGKILL: replaced")
    kept.set("fth/recover/0/0/cause/1", replacement.to_json())  # rank 1's replacement is already in
    kept.add("fth/recover/0/0/arrived", 1)
    decision = recovery._agree((kept, 0, 2, "gloo", timedelta(seconds=30)), killed)
    assert decision.restart and decision.why.startswith("rank 1 failed: RankReplaced"), decision


class Unanswering:
    """The first attempt's store with its host or link gone: every call blocks (a TCP read on a cut
    link waits for minutes) until the test releases it."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.calls: list[str] = []

    def set_timeout(self, timeout) -> None:
        pass

    def _call(self, name: str):
        self.calls.append(name)
        self.released.wait(30)
        raise RuntimeError("Connection reset by peer")

    def set(self, *args):
        return self._call("set")

    def add(self, *args):
        return self._call("add")

    def check(self, *args):
        return self._call("check")


def test_a_rank_that_ends_tells_its_peers_within_a_bound_and_does_not_wait_for_a_store_that_is_gone():
    store = Unanswering()
    lost = cause_of(peer("PeerLost", "declared"), 1)
    assert lost.not_in_place
    t0 = time.monotonic()
    try:
        decision = _Recovery(print, 3, timedelta(seconds=60))._agree((store, 1, 2, "gloo", timedelta(seconds=60)), lost)
    finally:
        store.released.set()
    took = time.monotonic() - t0
    assert not decision.restart and decision.why == lost.not_in_place
    assert store.calls == ["set"]  # its cause, given up on at the bound
    assert RECOVER_TELL_SEC - 0.1 <= took <= RECOVER_TELL_SEC + 1.5, f"took {took:.1f} s"


# -- live state: what each rank holds, and rank 0's plan ----------------------------------------------------
def test_a_live_report_read_from_the_store_is_bounded_and_checked():
    good = LiveReport(1, 36, "iteration", "")
    assert LiveReport.from_json(good.to_json(), world_size=2) == good
    assert LiveReport.from_json(good.to_json(), world_size=1) is None
    assert LiveReport.from_json(b"x" * 9000, world_size=2) is None
    assert LiveReport.from_json(json.dumps({"by": 0, "step": "x", "unit": "", "why": ""}).encode(), world_size=2) is None
    loud = LiveReport(0, -1, "", "\x1b[31m" + "z" * 5000).to_json()
    read = LiveReport.from_json(loud, world_size=2)
    assert "\x1b" not in read.why and len(read.why) <= 300


A = "a" * 32  # two checksums
B = "b" * 32


def held(rank: int, step: int, checksum: str = A, rng: str = "0000abcd", portable: str = "") -> LiveReport:
    return LiveReport(rank, step, "iteration", "", checksum, rng, portable)


def test_live_state_serves_each_rank_its_own_when_every_rank_holds_the_same_step():
    assert plan_live([held(0, 36), held(1, 36)], 2) == LivePlan(36, "iteration", "")
    assert plan_live([held(0, 36), held(1, 36)], 2).describe() == "live state, iteration 36 (each rank's own), is held for the next call"


def test_a_rank_without_state_a_step_behind_or_diverged_receives_from_the_lowest_agreeing_rank():
    replaced = LiveReport(1, -1, "", "its process was replaced")
    plan = plan_live([held(0, 36), replaced, held(2, 35), held(3, 36, B), held(4, 36)], 5)
    assert (plan.step, plan.source, plan.receivers, plan.checksum, plan.rng_shared) == (36, 0, (1, 2, 3), A, (0,))
    assert plan.whom == ("rank 1: its process was replaced; rank 2: a step behind (iteration 35); rank 3: its "
                         "state's checksum differs (diverged)")
    assert "sent from rank 0 to rank 1: its process was replaced;" in plan.describe()
    # the checksum most ranks hold wins, whichever rank is lowest
    assert plan_live([held(0, 36, B), held(1, 36), held(2, 36)], 3).receivers == (0,)
    assert plan_live([held(0, 36, B), held(1, 36), held(2, 36)], 3).source == 1
    # a tie: the lowest rank's checksum
    assert plan_live([held(0, 36, B), held(1, 36)], 2).source == 0
    # the newest step wins: a rank that completed it holds what every rank would
    assert plan_live([held(0, 36), held(1, 37)], 2).source == 1


def test_the_source_sends_its_rng_only_when_the_ranks_at_that_step_recorded_the_same():
    replaced = LiveReport(2, -1, "", "its process was replaced")
    assert not plan_live([held(0, 36, rng="00000001"), held(1, 36, rng="00000002"), replaced], 3).rng_shared
    assert not plan_live([held(0, 36, rng=""), held(1, 36, rng=""), replaced], 3).rng_shared
    assert plan_live([held(0, 36), held(1, 35, rng="00000002"), replaced], 3).rng_shared  # behind: another step's


def test_each_part_of_the_rng_states_is_sent_when_the_ranks_at_that_step_recorded_the_same():
    """Torch's, Python's ``random``, numpy's (a CRC-32 each): a script that seeds torch alike on every rank
    and leaves ``random`` to each process still sends torch's."""
    replaced = LiveReport(2, -1, "", "its process was replaced")
    torch_, python, numpy_ = "0000000a", "0000000b", "0000000c"
    alike = plan_live([held(0, 36, rng=torch_ + python + numpy_), held(1, 36, rng=torch_ + python + numpy_),
                       replaced], 3)
    assert alike.rng_shared == (0, 1, 2) and "; its RNG states too), is held" in alike.describe()
    own_random = plan_live([held(0, 36, rng=torch_ + python + numpy_), held(1, 36, rng=torch_ + "0000000f" + numpy_),
                            replaced], 3)
    assert own_random.rng_shared == (0, 2)
    assert "; its RNG states too, but not Python's random (the ranks' differ)), is held" in own_random.describe()
    decision = Decision(True, "recover", live=own_random)  # read back from the store: parts 0 to 2
    assert Decision.from_json(decision.to_json(), world_size=3) == decision
    bad = json.loads(decision.to_json())
    bad["live"]["rng_shared"] = [3]
    assert Decision.from_json(json.dumps(bad), world_size=3).live is None


def test_live_state_falls_back_to_the_checkpoint_and_says_why():
    def why(*reports):
        plan = plan_live(list(reports), len(reports))
        assert plan.step == -1 and "(live state cannot serve: " in plan.describe()
        return plan.why

    none = LiveReport(0, -1, "", "FTH_LIVE_STATE=0")
    assert why(none, LiveReport(1, -1, "", "x")) == "no rank holds live state (rank 0: FTH_LIVE_STATE=0)"
    assert why(held(0, 37), held(1, 35)) == "the ranks completed steps too far apart (rank 0 at iteration 37, " \
                                            "rank 1 at iteration 35)"
    assert why(held(0, 36), LiveReport(1, 36, "global step", "")).startswith("the ranks completed steps too far apart")
    assert why(held(0, 36, portable="state['x']: a Foo"), LiveReport(1, -1, "", "replaced")) == \
        "rank 1: replaced, and rank 0's state cannot be sent: state['x']: a Foo"
    assert plan_live([held(0, 36), None], 2).why == "rank 1's report could not be read"
    # nobody needs to receive: a state that cannot be sent serves its own rank
    assert plan_live([held(0, 36, portable="x"), held(1, 36, portable="x")], 2).step == 36


def shard(rank: int, step: int, checksum: str = "0badf00d") -> LiveReport:
    return LiveReport(rank, step, "iteration", "", checksum, "0000abcd", shard=True)


def test_a_sharded_models_ranks_each_resume_from_their_own_shard_when_every_rank_holds_it_at_one_step():
    """Shards differ by rank (their checksums too): nobody is "diverged", nobody receives. Before
    this, a sharded model's live state was refused and every rank resumed from its checkpoint."""
    plan = plan_live([shard(0, 36, "00000001"), shard(1, 36, "00000002"), shard(2, 36, "00000003")], 3)
    assert plan == LivePlan(36, "iteration", "")
    assert LiveReport.from_json(shard(1, 36).to_json(), world_size=2) == shard(1, 36)


def test_a_sharded_model_falls_back_to_the_checkpoint_when_a_shard_is_missing_refused_or_of_another_step():
    refused = LiveReport(1, -1, "", "SnapshotChecksumError: its shard of iteration 36 does not have its checksum")
    assert plan_live([shard(0, 36), refused], 2).why == (
        "rank 1 holds no shard of its own (SnapshotChecksumError: its shard of iteration 36 does not have its "
        "checksum), and no other rank holds a copy of it")
    replaced = LiveReport(0, -1, "", "its process was replaced (its state ended with it)")
    assert plan_live([replaced, shard(1, 36)], 2).why.startswith("rank 0 holds no shard of its own (its process was")
    assert plan_live([shard(0, 36), shard(1, 37)], 2).why == (
        "the ranks' shards are of different steps (rank 0 at iteration 36, another at iteration 37)")
    assert plan_live([shard(0, 36), held(1, 36)], 2).why.startswith("rank 1 holds no shard of its own (its state is not")


def test_a_plan_read_back_is_bounded_and_its_ranks_checked():
    plan = plan_live([held(0, 36), LiveReport(1, -1, "", "replaced")], 2)

    def read(live, world=2):
        told = json.loads(Decision(True, "rank 1 failed").to_json()) | {"live": live}
        return Decision.from_json(json.dumps(told).encode(), world)

    assert read({"step": "x"}).live is None  # the plan is not believed: every rank resumes from its checkpoint
    assert read(asdict(plan)).live == plan
    assert plan.checked(2) == plan
    assert plan.checked(1).why == "rank 0's plan names ranks outside the world"
    assert read(asdict(plan), world=1).live is None  # its ranks are not ranks of this world
    hostile = read({**asdict(plan), "checksum": "not hex!", "whom": "\x1b[31m" + "z" * 5000}).live
    assert hostile.checksum == "" and "\x1b" not in hostile.whom and len(hostile.whom) <= 400
    assert read({**asdict(plan), "receivers": "ab"}).live is None
    assert LiveReport.from_json(json.dumps({**asdict(held(0, 36)), "checksum": "ZZ"}).encode(), 2).checksum == ""


def test_rank_0s_decision_carries_the_plan_every_rank_follows():
    store = dist.HashStore()
    for rank, step in ((0, 36), (1, 36)):
        store.set(f"fth/recover/0/0/live/{rank}", LiveReport(rank, step, "iteration", "").to_json())
    decision = decide(store, [failure(0), failure(1)])
    assert decision.restart and decision.live == LivePlan(36, "iteration", "")
    assert Decision.from_json(decision.to_json(), 2) == decision
    apart = dist.HashStore()
    apart.set("fth/recover/0/0/live/0", LiveReport(0, 36, "iteration", "").to_json())
    assert decide(apart, [failure(0), failure(1)]).live.why == "rank 1's report could not be read"


def test_an_error_raised_before_any_process_group_is_raised_as_itself(caplog, monkeypatch):
    """``trainer.fit(ckpt_path=latest_checkpoint(None))`` raises a TypeError before Lightning made the
    group: it is the job's own error, raised unchanged, with no note and no line saying the recovery
    found no store (it said so before, as if the recovery were the problem)."""
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def train():
        raise TypeError("latest_checkpoint(dirname=None): expected a str or os.PathLike")

    with caplog.at_level("INFO", logger="fault_tolerant_handlers"):
        with pytest.raises(TypeError, match="expected a str or os.PathLike") as raised:
            recover_in_place(train, max_restarts=2)()
    assert not getattr(raised.value, "__notes__", None), raised.value.__notes__
    assert "not recovered in place" not in caplog.text and "no process group store" not in caplog.text


# -- a lost shard from a partner's copy (issue 42, item 2) ---------------------------------------------

def test_a_lost_ranks_shard_comes_from_its_partners_copy_at_the_newest_step_every_shard_is_held():
    """Rank 1 was SIGKILLed at iteration 37 and replaced: rank 0 holds its own shard of 36 and a copy of
    rank 1's of 36 (checksum verified): every rank carries on from 36, rank 1's shard sent from rank 0.
    Before this, every rank went back to the checkpoint."""
    replaced_1 = LiveReport(1, -1, "", "its process was replaced (its state ended with it)")
    survivor = LiveReport(0, 36, "iteration", "", "00000001", "0000abcd", shard=True, copies=(1, 36, 0xbeef, 0, 36, 1))
    plan = plan_live([survivor, replaced_1], 2)
    assert (plan.step, plan.shards, plan.why) == (36, (1, 0, 0xbeef), ""), plan
    assert "rank 1: its shard of iteration 36 from rank 0's copy" in plan.describe()
    assert LiveReport.from_json(survivor.to_json(), world_size=2) == survivor  # bounded JSON, read back whole


def test_the_agreed_step_is_the_newest_one_every_shard_is_held_at_own_copies_included():
    """The copy of rank 1's shard of 36 had not arrived when it was killed (sent off the training
    thread): rank 0 goes back to its own replica of 35, rank 1's comes from rank 0's copy of 35, and
    the plan says that 36 is computed again, and why (before, its line named only where each shard came
    from, and the loop's start then said "no step computed twice")."""
    lost = LiveReport(1, -1, "", "its process was replaced")
    survivor = LiveReport(0, 36, "iteration", "", "00000001", shard=True, copies=(1, 35, 7, 0, 35, 9))
    plan = plan_live([survivor, lost], 2)
    assert (plan.step, plan.shards) == (35, (0, 0, 9, 1, 0, 7)), plan
    assert plan.whom.endswith("; iteration 36 computed again: rank 1's shard of it is held nowhere"), plan.whom


def test_a_lost_ranks_copy_a_step_ahead_of_a_survivor_still_meets_it_at_the_step_before():
    """Rank 1 completed iteration 37 and its copy of 37 reached rank 2 before rank 1 was killed; rank 0
    failed before capturing 37 (its capture and replicas end at 36). Rank 2 holds rank 1's copies of
    37 and 36 (``ShardReplicas`` keeps each partner's two newest): every rank meets at 36. With only
    the newest copy held, no step had every shard and every rank went back to its checkpoint
    (``test_shard_replicas.py`` checks that the holder keeps both)."""
    lost = LiveReport(1, -1, "", "its process was replaced")
    behind = LiveReport(0, 36, "iteration", "", "00000001", shard=True, copies=(2, 36, 5, 0, 36, 1, 0, 35, 2))
    ahead = LiveReport(2, 37, "iteration", "", "00000003", shard=True, copies=(1, 37, 8, 1, 36, 7, 2, 37, 3, 2, 36, 4))
    plan = plan_live([behind, lost, ahead], 3)
    assert (plan.step, plan.shards) == (36, (1, 2, 7, 2, 2, 4)), plan
    only_newest = LiveReport(2, 37, "iteration", "", "00000003", shard=True, copies=(1, 37, 8, 2, 37, 3, 2, 36, 4))
    assert plan_live([behind, lost, only_newest], 3).why.startswith("no step every rank's shard is held at")


def test_a_lost_shard_nobody_holds_at_a_common_step_falls_back_to_the_checkpoint_by_name():
    lost = LiveReport(1, -1, "", "its process was replaced")
    no_copy = LiveReport(0, 36, "iteration", "", "00000001", shard=True)
    assert plan_live([no_copy, lost], 2).why.startswith("rank 1 holds no shard of its own (its process was replaced), "
                                                        "and no other rank holds a copy of it")
    stale = LiveReport(0, 36, "iteration", "", "00000001", shard=True, copies=(1, 30, 7))
    assert plan_live([stale, lost], 2).why == ("no step every rank's shard is held at (rank 0: 36 (its own); "
                                               "rank 1: 30 (rank 0's copy))")


def test_a_report_whose_copies_are_not_triples_of_ranks_is_not_believed():
    bad = json.loads(LiveReport(0, 36, "iteration", "", shard=True, copies=(1, 36, 7)).to_json())
    assert LiveReport.from_json(json.dumps({**bad, "copies": [1, 36]}).encode(), 2) is None
    assert LiveReport.from_json(json.dumps({**bad, "copies": [5, 36, 7]}).encode(), 2) is None
    plan = LivePlan(36, "iteration", "", shards=(1, 0, 7))
    assert plan.checked(2) == plan and plan.checked(1).why == "rank 0's plan names ranks outside the world"
    assert LivePlan(36, "iteration", "", shards=(0, 1, 7)).checked(1).why == "rank 0's plan names ranks outside the world"
    assert LivePlan(36, "iteration", "", shards=(0, 0)).checked(1).why == "rank 0's plan names ranks outside the world"


def test_each_attempt_gets_the_arguments_as_first_given_its_plain_containers_copied():
    import argparse

    from fault_tolerant_handlers.recover.inplace import _fresh

    dataset = object()  # not a container: the same object (a dataset is never copied)
    config = {"output_path": "/out", "layers": [1, 2], "ns": argparse.Namespace(lr=0.1), "data": dataset}
    given = _fresh(((0, config), {"seed": 1}))
    args, kwargs = _fresh(given)
    args[1]["output_path"] = "/out/run-0"  # what Ignite's cifar10 example does at each call
    args[1]["layers"].append(3)
    args[1]["ns"].lr = 1.0
    again, _ = _fresh(given)
    assert again[1]["output_path"] == "/out" and again[1]["layers"] == [1, 2] and again[1]["ns"].lr == 0.1
    assert again[1]["data"] is dataset and config["output_path"] == "/out"
    loop: dict = {}
    loop["self"] = loop
    assert _fresh(loop)["self"]  # a container that holds itself: copied to a depth, then as it is
