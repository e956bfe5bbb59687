"""Shard replicas over real ranks (gloo, FSDP2 ``fully_shard`` on CPU, ``programs/shard_replicas_main.py``):
after the last step every rank's partner (on the other simulated host) holds that rank's shard of that
step with a matching checksum; rebuilt from the partner's copy it is bit for bit the rank's own local
shards; a rank's own snapshot loads back into its FSDP2 model and optimizer; a flipped byte in a held
copy is refused by name; the threads end at ``stop()``. A rank SIGKILLed: its partner still holds its
shard of the last step, bit for bit, and the partner's training thread never waits for the failed send.
One 2-rank case in the default suite; 4 ranks and the SIGKILL ``long``."""

from __future__ import annotations

import pytest
import torch

from launch import HERE, run_ranks

PROGRAM = HERE / "programs" / "shard_replicas_main.py"
STEPS = 4

pytestmark = [pytest.mark.timeout(200), pytest.mark.slow]


def _run(world, hosts, tmp_path, partners=1, **env):
    results = run_ranks(world, "", tmp_path, script=PROGRAM, deadline=150,
                        env={"HOSTS": ",".join(hosts), "PARTNERS": str(partners), **env})
    for r in results:
        assert env or r.returncode == 0 and r.has("done"), r.stderr[-3000:]
    return results, tmp_path / f"shard_replicas_main-{world}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _check(results, outdir, hosts, partners):
    world = len(results)
    holders = {r: [] for r in range(world)}
    for res in results:
        to = res.event("partners")["to"]
        assert len(to) == partners and res.rank not in to
        if len(set(hosts)) > 1:
            assert all(hosts[p] != hosts[res.rank] for p in to)  # the copy is on another host
        for p in to:
            holders[res.rank].append(p)
    for res in results:
        own = res.event("own")
        assert own["dtensors"] > 0  # FSDP2's state: DTensor values
        assert own["home"] == [True] * (STEPS + 1) and own["late"] == 0, own  # each copy acknowledged by its next step
        held = res.event("held")["held"]
        assert sorted(h[0] for h in held) == sorted(r for r, ps in holders.items() if res.rank in ps)
        assert all(step == STEPS and ok for _, step, ok in held), held  # the last step, checksum matching
        for e in (x for x in res.events if x["event"] == "held_copy"):
            assert e["on_mesh_same"] and e["model_kinds"] == ["DTensor"], e
    for rank, ps in holders.items():
        own = torch.load(outdir / f"own-rank{rank}.pt")
        for p in ps:
            copy = torch.load(outdir / f"copy-of{rank}-by{p}.pt")
            assert [path for path, _ in copy] == [path for path, _ in own]
            for (path, a), (_, b) in zip(own, copy):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (rank, p, path)
                assert torch.equal(_bytes(a), _bytes(b)), (rank, p, path)  # bit for bit (NaN, -0.0 too)
    for res in results:
        reloaded = res.event("reloaded")
        assert reloaded["flushed"] and reloaded["step"] == STEPS and reloaded["moved"] and reloaded["same"], reloaded
        flipped = res.event("flipped")
        assert flipped["raised"] and flipped["raised"].startswith(
            f"SnapshotChecksumError: the snapshot of rank {flipped['rank']} at step {STEPS} does not have its checksum")
        assert [flipped["rank"], STEPS, False] in flipped["held"]
        stopped = res.event("stopped")
        assert stopped["threads_alive"] == [] and stopped["errors"] == [] and stopped["refused"] == 0, stopped
        assert stopped["sent"] + stopped["replaced"] == STEPS
        # a failure's capture gets the two newest of its own and of each copy it holds: a copy a step
        # ahead of a survivor's capture still meets it at the step before (before: only the newest copy)
        held_ranks = sorted(r for r, ps in holders.items() if res.rank in ps)
        assert stopped["kept"] == [[res.rank, STEPS - 1], [res.rank, STEPS]] + [
            [r, at] for r in held_ranks for at in (STEPS - 1, STEPS)], stopped


def test_two_ranks_on_two_hosts_hold_each_others_fsdp2_shard_exactly(tmp_path):
    hosts = ["node0", "node1"]
    results, outdir = _run(2, hosts, tmp_path)
    _check(results, outdir, hosts, 1)


def test_copies_go_on_after_a_pause_longer_than_the_replicas_timeout(tmp_path):
    """Every rank pauses 9 s after step 2's copy (a long evaluation), the replicas group's timeout 4 s:
    each partner's waiting receive is answered in time (a "still here" header every second), the
    copies of steps 3 and 4 arrive, nothing fails. Before, the receive timed out after 4 s, receiving
    stopped for the rest of the run ("receiving stopped: ... Timed out"), and no later copy was held."""
    hosts = ["node0", "node1"]
    results, outdir = _run(2, hosts, tmp_path, PAUSE="9", REPLICA_TIMEOUT="4")
    for r in results:
        assert r.returncode == 0 and r.has("done"), r.stderr[-3000:]
    _check(results, outdir, hosts, 1)


@pytest.mark.long
@pytest.mark.parametrize("hosts, partners", [(["node0", "node0", "node1", "node1"], 1),
                                             (["node0"] * 4, 2)], ids=["2x2", "1x4-two-copies"])
def test_four_ranks_hold_their_partners_fsdp2_shards_exactly(hosts, partners, tmp_path):
    results, outdir = _run(4, hosts, tmp_path, partners)
    _check(results, outdir, hosts, partners)


@pytest.mark.long
def test_a_rank_sigkilled_leaves_its_shard_in_its_partners_memory_and_training_never_waits(tmp_path):
    results, outdir = _run(2, ["node0", "node1"], tmp_path, KILL="1")
    assert results[1].returncode == -9 and results[1].has("dying"), results[1].stderr[-3000:]  # the fault fired
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    died = results[0].event("died")
    assert died["copy_step"] == STEPS and died["held"] == [[1, STEPS, True]], died
    own = torch.load(outdir / "own-rank1.pt")
    copy = torch.load(outdir / "after-death-copy-of1.pt")
    assert [p for p, _ in copy] == [p for p, _ in own]
    assert all(torch.equal(_bytes(a), _bytes(b)) for (_, a), (_, b) in zip(own, copy))
    # the sends failed (logged, counted) and each step() returned after its copy: not the 30 s send bound
    assert died["errors"] and all(c < 10 for c in died["calls"]), died
    assert died["threads_alive"] == [], died
    assert died["flushed"] and died["own_step"] == STEPS + 5, died  # its own snapshots are still taken
