"""torchrun's own summary: its "Root Cause" names the rank that failed and its fault, never a
survivor, for a raise, a SIGKILL and a hang (one run each; ``bench/torchrun_root_cause.py`` counts
many). Real Ignite DDP training on 2 gloo ranks under ``python -m torch.distributed.run``; a failing
rank that torchrun signals as it ends (4 ranks, Ignite and a plain loop)."""

from __future__ import annotations

import re

import pytest

from launch import PROGRAMS, run_ranks, torchrun_root_cause

SCRIPT = PROGRAMS / "ignite_main.py"

pytestmark = pytest.mark.timeout(120)

# fault -> (environment, what rank 1's Root Cause shows, what rank 0 raised)
CASES = {
    "raise": (dict(FAULT="step"), "RuntimeError: CUDA-like failure at iteration 3", "PeerFailedError"),
    "kill": (dict(FAULT="kill"), "SIGKILL", None),
    "hang": (dict(FAULT="hang", HANG="3"), "RankHung: rank 1 (pid ", None),
}


@pytest.mark.parametrize("fault", list(CASES))
def test_root_cause_is_the_failing_rank(tmp_path, fault):
    env, shown, _ = CASES[fault]
    results = run_ranks(1, "", tmp_path, script=SCRIPT, result_ranks=2, deadline=90,
                        env=dict(env, RERAISE="1", LINGER="0"),
                        launcher=["-m", "torch.distributed.run", "--nproc-per-node=2", "--monitor-interval=0.1"])
    output = results[0].stderr
    assert results[0].returncode != 0, output[-3000:]
    rank, block = torchrun_root_cause(output)
    assert rank == 1, output[-4000:]
    assert shown in block, block
    if fault != "kill":
        assert "error_file: <N/A>" not in block  # read from the file the library wrote
    # A killed rank writes nothing: its file comes from its liveness helper or a same-host survivor as
    # it ends, racing the agent's next look (every 0.1 s), so its text is the library's or, when the
    # race is lost, torch's (19 of 20 the library's, bench/torchrun_root_cause.py). The culprit and its
    # signal are right either way, which is what is asserted here; the file is tests/unit/launchers/test_errorfile.py's.
    assert results[1].event("fault")
    survivor = [e for e in results[0].events if e.get("event") == "run_raised"]
    if survivor:  # the survivor may also be ended by the watchdog or the agent first
        assert survivor[0]["raised"] == "PeerFailedError" and survivor[0]["failed_rank"] == 1


@pytest.mark.parametrize("form", ["ignite", "plain"])
def test_failing_rank_signalled_as_it_ends_exits_with_its_own_code(tmp_path, form):
    """Rank 1 of 4 raises ValueError, uncaught, and its interpreter takes 3 s to tear down (torch's
    teardown takes seconds on a loaded machine): the survivors exit first and torchrun sends rank 1 its
    SIGTERM during that teardown, where Python runs no signal handler. Rank 1 still ends with exit code
    1, so the Root Cause names it with its exception, not ``-15 (SIGTERM)``."""
    result = run_ranks(1, form, tmp_path, script=PROGRAMS / "programs" / "root_cause_main.py", deadline=60,
                       env=dict(TEARDOWN="3"),
                       launcher=["-m", "torch.distributed.run", "--nproc-per-node=4", "--max-restarts=0"])[0]
    output = result.stderr
    assert result.returncode == 1, output[-3000:]
    rank, block = torchrun_root_cause(output)
    assert rank == 1 and "(local_rank: 1)" in block, output[-4000:]
    pid = re.search(r"exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", block)
    assert pid is not None and pid.group(1) == "1", block
    assert "ValueError: bad batch at iteration 5" in block, block
    assert f"Sending process {pid.group(2)} closing signal SIGTERM" in output, output[-4000:]  # the fault fired
