"""Under torchrun, every attempt's process groups live in their own store namespace (``_compat_torchrun``).

One process stands in for a restarted torchrun worker: it hosts a TCPStore as torchrun's agent does
and initializes a gloo group the way torchrun's workers do (``env://`` with
``TORCHELASTIC_USE_AGENT_STORE=True``, ``TORCHELASTIC_RESTART_COUNT=3``). The group's keys must land
under ``fth/attempt_3/`` and not under torch's bare names, which every attempt shares (so the keys
attempt 2 left under the same names can never be read). The full picture (20 restarts in a row of a
real torchrun job) is ``bench/restart_loop.py``.
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


LATE = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
        "--monitor-interval", "0.5"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["raise", pytest.param("kill", marks=pytest.mark.long)])  # suite time: the raise deletes on both paths (the failing rank's and the survivor's)
def test_a_restart_comes_up_when_the_library_is_imported_after_init_process_group(fault, tmp_path):
    """The script initializes the process group, then imports the library: the first attempt's
    groups write their keys under torch's bare names in torchrun's shared store. Rank 1 fails in
    attempt 0 (an exception, or SIGKILL); in attempt 1 it starts late, so rank 0 would read its
    address of attempt 0 if it were left. Attempt 1 must come up and train to the end on both ranks."""
    from launch import kill_workers, run_ranks

    script = ROOT / "tests" / "late_import_main.py"
    run_dir = tmp_path / "late_import_main-1"
    try:
        results = run_ranks(1, "", tmp_path, script=script, launcher=LATE, deadline=180, env={"FAULT": fault})
    finally:
        kill_workers(run_dir, program="late_import_main.py")
    output = results[0].stderr
    assert results[0].returncode == 0, output[-5000:]
    first = [json.loads((run_dir / f"attempt0_rank{r}.json").read_text()) for r in (0, 1)]
    assert all("finished" not in a for a in first), first  # the fault ended attempt 0 on both ranks
    second = [json.loads((run_dir / f"attempt1_rank{r}.json").read_text()) for r in (0, 1)]
    assert [a.get("finished") for a in second] == [20, 20], (second, output[-5000:])
    assert not (run_dir / "attempt2_rank0.json").exists()  # attempt 1 came up at once
    assert "deleted this attempt's" in output
