"""Shard replicas without ranks: partner choice on host layouts, settings refused by name, snapshot
round trips, and a corrupt, oversized or malformed manifest or payload refused before anything is
rebuilt (the bytes may come from a peer)."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from datetime import timedelta

import numpy
import pytest
import torch

from fault_tolerant_handlers.core.sharded import (
    MAX_MANIFEST_BYTES, ManifestError, Snapshot, SnapshotChecksumError, _describe, read_manifest, restore,
    rng_of, take_snapshot)
from fault_tolerant_handlers.data.replicas import ShardReplicas, choose_partners, held_by


def _hosts(*counts: int) -> list[str]:
    return [f"node{h}" for h, n in enumerate(counts) for _ in range(n)]


def _check_layout(hosts, partners):
    chosen = choose_partners(hosts, partners)
    assert len(chosen) == len(hosts)
    for rank, ps in enumerate(chosen):
        assert len(ps) == partners == len(set(ps)) and rank not in ps
    return chosen


@pytest.mark.parametrize("counts", [(2, 2), (4,) * 4, (2,) * 4, (8,) * 64], ids=["2x2", "4x4", "4x2", "64x8"])
def test_every_copy_is_on_another_host_at_the_same_place_and_each_rank_holds_one(counts, caplog):
    hosts = _hosts(*counts)
    with caplog.at_level(logging.WARNING, "fault_tolerant_handlers"):
        chosen = _check_layout(hosts, 1)
    per_host = counts[0]
    for rank, (p,) in enumerate(chosen):
        assert hosts[p] != hosts[rank]
        assert p == (rank + per_host) % len(hosts)  # NVIDIA's clique rule: replication_jump = ranks per host
    assert Counter(p for (p,) in chosen) == Counter(range(len(hosts)))  # one copy held per rank
    assert not caplog.records  # nothing on its own host: no warning


def test_two_copies_go_to_the_next_two_hosts_and_are_held_evenly():
    hosts = _hosts(*(8,) * 64)
    chosen = _check_layout(hosts, 2)
    assert chosen[0] == (8, 16) and chosen[511] == (7, 15)
    assert {len({hosts[r], *(hosts[p] for p in ps)}) for r, ps in enumerate(chosen)} == {3}
    assert all(len(held_by(chosen, r)) == 2 for r in range(len(hosts)))


def test_one_host_falls_back_to_a_neighbour_on_the_same_host_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, "fault_tolerant_handlers"):
        chosen = _check_layout(_hosts(4), 1)
    assert chosen == [(1,), (2,), (3,), (0,)]
    assert "4 of 4 copies are held on their own rank's host (1 host(s)" in caplog.text
    assert _check_layout(_hosts(4), 3)[0] == (1, 2, 3)


def test_uneven_hosts_keep_copies_off_their_host():
    hosts = _hosts(3, 1, 2)
    chosen = _check_layout(hosts, 1)
    assert all(hosts[p] != hosts[r] for r, (p,) in enumerate(chosen))
    assert chosen == [(3,), (3,), (3,), (4,), (0,), (1,)]
    assert held_by(chosen, 3) == [0, 1, 2]  # a host with fewer ranks than the one before holds more copies each
    # 2 hosts, 3 copies of a rank on a host of 3: one other host, then its own host (said in the log)
    chosen = _check_layout(_hosts(3, 1), 3)
    assert chosen[0] == (3, 1, 2) and chosen[3] == (0, 1, 2)


@pytest.mark.parametrize("partners, world", [(0, 4), (4, 4), (1, 1), (-1, 2)])
def test_partner_counts_outside_the_world_are_refused(partners, world):
    with pytest.raises(ValueError, match=r"partners=.*valid 1 \.\. world size - 1"):
        choose_partners(_hosts(world), partners)


@pytest.mark.parametrize("kwargs, named", [
    ({"replicate_every": 0}, r"replicate_every=0\): an int >= 1"),
    ({"replicate_every": 1.5}, r"replicate_every=1.5\): an int >= 1"),
    ({"partners": 0}, r"partners=0\): an int from 1 to the world size - 1"),
    ({"partners": True}, r"partners=True\)"),
    ({"enabled": "no"}, r"enabled='no'\): True or False"),
    ({"timeout": 5}, r"timeout=5\): a positive timedelta"),
    ({"wait": timedelta(seconds=-1)}, r"wait=.*\): a timedelta >= 0 \(0: never wait\)"),
])
def test_bad_settings_are_refused_at_construction_naming_the_argument_and_range(kwargs, named):
    with pytest.raises(ValueError, match=named):
        ShardReplicas(**kwargs)


def test_disabled_replicas_make_nothing_and_take_no_snapshot():
    replicas = ShardReplicas(enabled=False)  # no process group needed: nothing is made
    assert replicas.step({"w": torch.ones(3)}, 1) is False and replicas.held() == [] and replicas.own() is None
    replicas.stop()


def _state():
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(3, 5), "b": torch.randn(5).to(torch.bfloat16), "n": torch.tensor(7)},
            "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 5)[:, 1:]}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "eps": float("inf")}]},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": numpy.random.get_state()},
            "iteration": 12, "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False]), "name": None}


def _assert_same(a, b, path="state"):
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, numpy.ndarray):
        assert a.dtype == b.dtype and numpy.array_equal(a, b), path
    else:
        assert a == b, path


def test_a_snapshot_round_trips_a_state_bit_for_bit_with_its_structure():
    state = _state()
    snap = take_snapshot(state, 12, 3)
    assert snap.step == 12 and snap.rank == 3 and snap.verify()
    back = restore(snap)
    _assert_same(state, back)
    state["model"]["w"].add_(1)  # a copy: training on does not change the snapshot
    assert snap.verify() and not torch.equal(restore(snap)["model"]["w"], state["model"]["w"])
    numpy.random.set_state(back["rng"]["numpy"])  # RNG states load as they were
    random.setstate(back["rng"]["python"])
    assert _describe(state)[1][0]["path"] == "state['model']['w']"  # the leaves' paths


def test_a_flipped_byte_in_the_payload_or_manifest_is_refused_by_name():
    snap = take_snapshot(_state(), 5, 0)
    snap.payload[17] ^= 1
    with pytest.raises(SnapshotChecksumError, match="rank 0 at step 5 does not have its checksum"):
        restore(snap)
    snap.payload[17] ^= 1
    restore(snap)
    bad = Snapshot(0, 5, snap.manifest.replace(b'"step":5', b'"step":6'), snap.payload, snap.checksum)
    with pytest.raises(SnapshotChecksumError):
        restore(bad)
    with pytest.raises(SnapshotChecksumError):
        restore(take_snapshot(_state(), 5, 0, seal=False))  # never sealed: never loaded


def _resealed(snap: Snapshot, manifest: bytes) -> Snapshot:
    """A snapshot whose checksum matches a forged manifest (a peer that sends garbage consistently)."""
    return Snapshot(snap.rank, snap.step, manifest, snap.payload).seal()


@pytest.mark.parametrize("forge, why", [
    (lambda m: b"\x80not json", "not JSON"),
    (lambda m: b"[" * 100_000 + b"]" * 100_000, "not JSON|not a fth-shard-2"),
    (lambda m: json.dumps({**m, "format": "pickle"}).encode(), "not a fth-shard-2 manifest"),
    (lambda m: json.dumps({**m, "bytes": m["bytes"] + 1}).encode(), "the payload has"),
    (lambda m: json.dumps({**m, "leaves": [{**m["leaves"][0], "offset": m["bytes"]}] + m["leaves"][1:]}).encode(),
     "leaf 0 .* does not fit the payload"),
    (lambda m: json.dumps({**m, "leaves": [{**m["leaves"][0], "shape": [10**9]}] + m["leaves"][1:]}).encode(),
     "leaf 0 .* does not fit"),
    (lambda m: json.dumps({**m, "leaves": [{**m["leaves"][0], "dtype": "object"}] + m["leaves"][1:]}).encode(),
     "leaf 0 .* does not fit"),
    (lambda m: json.dumps({**m, "tree": {"T": 10**6}}).encode(), "names leaf 1000000"),
    (lambda m: json.dumps({**m, "tree": {"x": 1}}).encode(), "malformed node"),
    (lambda m: json.dumps({**m, "tree": {"d": [[[1], {"T": 0}]]}}).encode(), "malformed key"),
    (lambda m: json.dumps(m).encode() + b" " * MAX_MANIFEST_BYTES, "more than 16777216"),
], ids=["binary", "deep", "format", "bytes", "offset", "shape", "dtype", "leaf-index", "node", "key", "oversized"])
def test_a_malformed_or_oversized_manifest_is_refused_before_anything_is_rebuilt(forge, why):
    snap = take_snapshot(_state(), 5, 0)
    with pytest.raises(ManifestError, match=why):
        restore(_resealed(snap, forge(json.loads(snap.manifest))))


def test_read_manifest_checks_the_size_before_parsing():
    with pytest.raises(ManifestError, match="more than"):
        read_manifest(b"{" * (MAX_MANIFEST_BYTES + 1), 0)


def test_values_a_snapshot_cannot_carry_are_named_by_path():
    with pytest.raises(TypeError, match=r"state\['opt'\]\[1\] is a builtins.set"):
        take_snapshot({"opt": [1, {2}]}, 0, 0)
    with pytest.raises(TypeError, match=r"has a key tensor\(1\) of type Tensor"):
        take_snapshot({torch.tensor(1): 1}, 0, 0)
    assert restore(take_snapshot({(1, "a"): b"\x00", None: [float("nan")]}, 0, 0))[(1, "a")] == b"\x00"


def test_a_snapshot_takes_subclasses_as_their_plain_container_and_keeps_a_state_dicts_metadata():
    """Live state refuses a ``defaultdict`` or a named tuple (a receiver could not rebuild it); a
    snapshot, loaded on its own rank, takes them as a dict and a tuple, as before the one codec."""
    from collections import OrderedDict, defaultdict, namedtuple

    meta = OrderedDict(w=torch.ones(2))
    meta._metadata = {"": {"version": 2}}
    back = restore(take_snapshot({"d": defaultdict(int, a=1), "p": namedtuple("P", "x")(3), "m": meta}, 0, 0))
    assert back["d"] == {"a": 1} and type(back["d"]) is dict and back["p"] == (3,) and type(back["p"]) is tuple
    assert type(back["m"]) is OrderedDict and back["m"]._metadata == {"": {"version": 2}}


def test_a_buffer_is_written_again_only_when_no_one_refers_to_its_snapshot():
    from fault_tolerant_handlers.data.replicas import _unused
    first = take_snapshot(_state(), 1, 0)
    assert _unused(first)
    kept = first  # a caller of own() or copy_of() keeps it: its buffer is not reused
    assert not _unused(first)
    del kept
    payload = first.payload
    assert not _unused(first)
    del payload
    second = take_snapshot(_state(), 2, 0, buffer=first.payload)
    assert second.payload.data_ptr() == first.payload.data_ptr() and restore(second)["iteration"] == 12
    third = take_snapshot({"w": torch.ones(3)}, 3, 0, buffer=first.payload)  # another size: a new buffer
    assert third.payload.data_ptr() != first.payload.data_ptr()


# -- the recovery's side: what a rank reports of the copies it holds, and what it loads ------------------

def test_a_rank_reports_the_copies_it_holds_and_never_a_copy_whose_checksum_fails(monkeypatch, caplog):
    """The copies ``ShardReplicas.abort`` handed over (a partner's, this rank's own replica) are listed
    in the rank's report as (rank, step, CRC-32); a copy whose bytes changed while held is left out
    and named in an ERROR line (never loaded)."""
    from fault_tolerant_handlers.core.phases import RecoveryState
    from fault_tolerant_handlers.recover import live_state

    partner = take_snapshot({"w": torch.arange(4.0)}, 22, 1)
    own = take_snapshot({"w": torch.ones(4)}, 22, 0)
    flipped = take_snapshot({"w": torch.zeros(4)}, 21, 2)
    flipped.payload[0] ^= 1
    state = RecoveryState(live_why="no step completed", copies=(own, partner, flipped))
    monkeypatch.setattr(live_state.hooks, "run", lambda hook, _: state)
    held = live_state.Held(lambda **_: RecoveryState())
    with caplog.at_level(logging.ERROR, "fault_tolerant_handlers"):
        held.collect(0)
    assert held.report.copies == (0, 22, own.checksum, 1, 22, partner.checksum)
    assert sorted(held.copies) == [(0, 22), (1, 22)]
    assert "the copy of rank 2's shard of step 21 held here does not have its checksum" in caplog.text


def test_a_snapshot_carries_the_steps_rng_states_under_its_checksum():
    """A replaced rank's shard from a copy comes with that rank's RNG states of the same step (a step
    that draws, dropout, then draws as it did); a byte of them changed is refused like the state's."""
    torch.manual_seed(5)
    torch.rand(3)
    rng = (torch.get_rng_state(), None)
    snap = take_snapshot({"w": torch.ones(3)}, 7, 1, rng=rng)
    back = rng_of(snap)
    assert type(back) is tuple and back[1] is None and torch.equal(back[0], rng[0])
    expected = torch.rand(4)
    torch.manual_seed(0)
    torch.set_rng_state(back[0])
    assert torch.equal(torch.rand(4), expected)
    assert rng_of(take_snapshot({"w": torch.ones(3)}, 7, 1)) is None  # none recorded: none restored
    cuda = (torch.get_rng_state(), [torch.arange(16, dtype=torch.uint8)])  # (cpu, [per CUDA device])
    assert torch.equal(rng_of(take_snapshot({}, 7, 1, rng=cuda))[1][0], cuda[1][0])
    leaf = json.loads(snap.manifest)["leaves"][-1]
    snap.payload[leaf["offset"]] ^= 1
    with pytest.raises(SnapshotChecksumError):
        rng_of(snap)


def test_a_shard_received_is_loaded_only_with_the_agreed_checksum():
    from fault_tolerant_handlers.recover.live_state import LivePlan
    from fault_tolerant_handlers.recover.live_state import _unwire, _wire

    rng = (torch.get_rng_state(), None)
    snap = take_snapshot({"w": torch.arange(6.0)}, 22, 1, rng=rng)
    plan = LivePlan(22, "iteration", "", shards=(1, 0, snap.checksum))
    captured, why = _unwire(_wire(snap, "/ckpts"), 1, plan, snap.checksum, 0)
    assert why == "" and (captured.step, captured.unit, captured.directory) == (22, "iteration", "/ckpts")
    assert torch.equal(restore(captured.state)["w"], torch.arange(6.0))
    assert torch.equal(captured.rng[0], rng[0]) and captured.rng[1] is None  # the rank's RNG of that step
    wire = _wire(snap, None)
    wire["payload"] = wire["payload"].clone()
    wire["payload"][3] ^= 1  # a byte changed on its way
    captured, why = _unwire(wire, 1, plan, snap.checksum, 0)
    assert captured is None and why.startswith("SnapshotChecksumError: the copy of rank 1's shard of step 22 from "
                                               "rank 0 does not have the agreed checksum")
    assert _unwire(_wire(snap, None), 1, plan, snap.checksum ^ 1, 0)[0] is None  # not the CRC agreed on
    assert "malformed" in _unwire({"rank": 1}, 1, plan, snap.checksum, 0)[1]


def test_a_holder_that_stopped_acknowledging_costs_one_wait_not_one_a_step(caplog):
    """A partner alive but no longer receiving (its receiving thread ended): the send of step 3 waits
    for an acknowledgement that comes only at the group's timeout. The next step waits for it once
    (``wait``); the steps after do not wait while that send goes on; once it ends, waiting resumes."""
    import threading

    waits = []

    class Counted(threading.Condition):
        def wait_for(self, predicate, timeout=None):
            waits.append(timeout)
            return super().wait_for(predicate, timeout)

    replicas = ShardReplicas(enabled=False)  # the sending thread played by hand: no process group
    replicas.enabled, replicas.wait, replicas.to = True, timedelta(seconds=0.2), (1,)
    replicas._cond, replicas.taken, replicas._sending = Counted(), 3, True
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert [replicas.wait_home() for _ in range(5)] == [False] * 5
    assert waits == [0.2], waits  # one wait, then none while the send of step 3 goes on
    assert replicas.stats.late == 5 and replicas.stats.waited < 2.0
    assert sum("is not held by rank(s) 1" in r.getMessage() for r in caplog.records) == 1
    with replicas._cond:  # the send ends (the group's timeout) as the sending thread ends it
        replicas._sending = replicas._stalled = False
        replicas._home[1] = 3
    assert replicas.wait_home() is True and len(waits) == 2


def test_a_step_sent_again_keeps_the_step_before_as_the_older_own_snapshot():
    """The loader drew from torch's RNG before the next step: step 2 is sent again with the RNG now.
    The rank's two own snapshots are then steps 1 and 2 (the newer with the later RNG), not 2 twice: a
    partner whose copy of step 2 had not arrived still finds a step in common (1)."""
    import threading

    replicas = ShardReplicas(enabled=False)  # the sending thread with no partner: nothing leaves the process
    replicas.enabled, replicas.rank, replicas.to = True, 0, ()
    sender = threading.Thread(target=replicas._send_loop, daemon=True)
    sender.start()
    for step, rng in ((1, 10), (2, 20), (2, 21)):
        replicas.step({"w": torch.full((3,), float(step))}, step, (torch.tensor([rng], dtype=torch.uint8), None))
        assert replicas.flush(timedelta(seconds=30))
    own = replicas.abort()
    sender.join(30)
    assert [s.step for s in own] == [1, 2]
    assert int(restore(own[1])["w"][0]) == 2 and not sender.is_alive()


def test_the_partners_and_the_wait_are_settings_checked_by_name(monkeypatch):
    from fault_tolerant_handlers.core import config

    monkeypatch.setenv("FTH_SHARD_PARTNERS", "2")
    monkeypatch.setenv("FTH_SHARD_REPLICA_WAIT_SEC", "0")
    rule = config.settings()
    assert rule.shard_partners == 2 and rule.shard_replica_wait == timedelta(0)
    for name, bad, told in (("FTH_SHARD_PARTNERS", "0", "from 1 to 1024"),
                            ("FTH_SHARD_REPLICA_WAIT_SEC", "-1", "from 0 to 600")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}': expected .*{told}"):
            config.settings()
        monkeypatch.delenv(name)


def test_a_failure_collects_the_copies_of_the_loops_still_running_once():
    """The replicas an adapter's loop made ride on its step tracker (``StepTracker.replicas``): at a
    failure each running loop's are aborted and their copies collected, once; a loop that ended (its
    tracker closed, its replicas stopped) is not asked."""
    from fault_tolerant_handlers.data import live

    class Replicas:
        def __init__(self, snaps):
            self.snaps, self.aborted = snaps, 0

        def abort(self):
            self.aborted += 1
            return list(self.snaps)

    running, ended = (live.StepTracker([], update_at_pre_hook=True) for _ in range(2))
    running.replicas, ended.replicas = Replicas(["own", "partner's"]), Replicas(["old"])
    ended.close()
    try:
        assert live.replica_copies() == ("own", "partner's")
        with pytest.raises(live.NotLive):
            live.collect()  # no loop registered a capture; the trackers end with it
        assert live.replica_copies() == () and (running.replicas.aborted, ended.replicas.aborted) == (1, 0)
    finally:
        live.forget()
