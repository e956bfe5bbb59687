"""Under torchrun, every attempt's process groups live in their own store namespace (``_compat_torchrun``).

One process stands in for a restarted torchrun worker: it hosts a TCPStore as torchrun's agent does
and initializes a gloo group the way torchrun's workers do (``env://`` with
``TORCHELASTIC_USE_AGENT_STORE=True``, ``TORCHELASTIC_RESTART_COUNT=3``). The group's keys must land
under ``fth/attempt_3/`` and not under torch's bare names, which every attempt shares (so the keys
attempt 2 left under the same names can never be read). The full picture (20 restarts in a row of a
real torchrun job) is ``bench/restart_loop.py``.

Issue 27: a real ``torchrun --max-restarts 2`` job of ``late_import_main.py`` (Ignite, DDP, a
checkpoint every epoch) at 4 ranks (8 in the long suite), rank 1 failing at iteration 14 by a raise
or SIGKILL, with the library imported after ``init_process_group`` or before it: every attempt
comes up, and the resumed run trains the batches of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch import ROOT, free_port

CHILD = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False)
    import fault_tolerant_handlers  # installs the per-attempt namespace
    from torch.distributed import distributed_c10d
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    distributed_c10d._get_default_store().set("probe", "attempt-local")
    expect = os.environ["EXPECT_PREFIX"]
    print("prefixed", server.check([expect + "default_pg/0//probe"]), "bare", server.check(["default_pg/0//probe"]))
    dist.destroy_process_group()
""")


def run_child(env: dict[str, str]) -> str:
    port = free_port()
    full = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                WORLD_SIZE="1", LOCAL_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True", **env)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


@pytest.mark.timeout(120)
def test_a_restarted_attempt_writes_under_its_own_prefix():
    assert run_child({"TORCHELASTIC_RESTART_COUNT": "3", "EXPECT_PREFIX": "fth/attempt_3/"}) == "prefixed True bare False"


@pytest.mark.timeout(120)
def test_opt_out_leaves_torchs_shared_namespace():
    out = run_child({"TORCHELASTIC_RESTART_COUNT": "3", "EXPECT_PREFIX": "fth/attempt_3/", "FTH_ATTEMPT_STORE": "0"})
    assert out == "prefixed False bare True"


def test_missing_private_table_is_named(monkeypatch):
    import importlib

    from fault_tolerant_handlers.launchers import compat_torchrun as _compat_torchrun

    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setattr(rendezvous, "_rendezvous_handlers", {"file": None})
    with pytest.raises(RuntimeError, match=r"_rendezvous_handlers has no handler for env, tcp .*FTH_ATTEMPT_STORE=0"):
        _compat_torchrun.install()


def uninterrupted(world: int, rank: int) -> dict[int, list[int]]:
    """The sample ids of every iteration of ``rank`` in an uninterrupted run of ``late_import_main.py``."""
    from torch.utils.data import DistributedSampler

    epoch_length, epochs, batch = 5, 4, 4
    sampler = DistributedSampler(range(batch * world * epoch_length), num_replicas=world, rank=rank, shuffle=True, seed=0)
    out = {}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ids = list(sampler)
        for j in range(epoch_length):
            out[epoch * epoch_length + j + 1] = ids[j * batch:(j + 1) * batch]
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.long)])
@pytest.mark.parametrize("fault", ["raise", "kill"])
@pytest.mark.parametrize("order", ["late", "early"])
def test_a_restart_comes_up_and_resumes_whatever_the_import_order(order, fault, world, tmp_path):
    """Issue 27: ``torchrun --max-restarts 2`` (its default ``--monitor-interval``, 0.1 s), Ignite,
    ``world`` ranks; the library is imported after ``init_process_group`` (``late``: the first
    attempt's groups write their keys under torch's bare names in torchrun's shared store) or before
    it. Rank 1 fails at iteration 14 of attempt 0 (an exception, or SIGKILL: torchrun's agent then
    ends the survivors with SIGTERM, often before they learned of the failure). In attempt 1 rank 1
    starts 1.5 s late, so its peers would read its address of attempt 0 if it were left. Every rank
    of both attempts must come up, attempt 1 resumes at iteration 10 (the last checkpoint) and
    trains the batches of an uninterrupted run to the end; there is no attempt 2."""
    from launch import kill_workers, run_ranks

    script = ROOT / "tests" / "late_import_main.py"
    run_dir = tmp_path / "late_import_main-1"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "--max-restarts", "2"]
    try:
        results = run_ranks(1, "", tmp_path, script=script, launcher=launcher, deadline=150 if world <= 4 else 360,
                            env={"FAULT": fault, "IMPORT": order, "FAIL_AT": "14"})
    finally:
        kill_workers(run_dir, program="late_import_main.py")
    output = results[0].stderr
    attempts = {int(p.name[len("attempt"):].split("_")[0]) for p in run_dir.glob("attempt*_rank*.json")}
    assert attempts == {0, 1}, (sorted(attempts), output[-5000:])  # attempt 1 came up at once
    assert results[0].returncode == 0, output[-5000:]
    first = [json.loads((run_dir / f"attempt0_rank{r}.json").read_text()) for r in range(world)]
    second = [json.loads((run_dir / f"attempt1_rank{r}.json").read_text()) for r in range(world)]
    assert all("up" in a and "finished" not in a for a in first), first  # the fault ended attempt 0 on every rank
    assert all("up" in a for a in second), second
    assert [a.get("resumed_at") for a in second] == [10] * world, second
    assert [a.get("finished") for a in second] == [20] * world, (second, output[-5000:])
    for rank in range(world):
        trained = [json.loads(line) for line in (run_dir / f"batches{rank}.jsonl").read_text().splitlines()]
        assert [it for a, it, _ in trained if a == 1] == list(range(11, 21)), (rank, trained)
        before = [it for a, it, _ in trained if a == 0]
        assert before == list(range(1, len(before) + 1)) and 10 <= len(before) <= 13, (rank, trained)
        kept = {it: ids for a, it, ids in trained if a == 1 or it <= 10}  # what the resumed run is made of
        assert kept == uninterrupted(world, rank), (rank, trained)
    if order == "late":
        assert "gloo address keys of" in output and "from torchrun's shared store" in output
        assert "cannot be found" not in output


