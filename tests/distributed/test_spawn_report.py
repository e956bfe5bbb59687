"""Under every launcher, the surviving rank's own output names the cause before its process ends:
the failing rank and its pid with ``killed by SIGKILL``, its exception with the remote traceback, or
``RankHung`` with the hung line of its stack. The launchers end survivors themselves:
``mp.spawn``-family ones (Ignite's ``idist.Parallel``, Lightning's ``ddp_spawn``) SIGTERM every
other rank as soon as one exits, Lightning's ``ddp`` SIGKILLs every rank within 5 s of a child's
failed exit, torchrun SIGTERMs the other workers. Real 2-rank gloo DDP trainings
(``tests/spawn_cases.py``), each rank's stdout/stderr in a file of its own.

The default suite runs four cases (10 to 15 s each on an idle machine; ``ddp_spawn`` with rank 1
SIGKILLed is also ``test_watchdog_distributed.py::test_sigkilled_peer_in_a_lightning_fit``);
``make test-long`` runs every launcher x fault; ``make bench-spawn`` counts them over 20 runs each.
"""

from __future__ import annotations

import pytest

from launch import torchrun_root_cause
from spawn_cases import LAUNCHERS, missing, run_case

pytestmark = pytest.mark.timeout(200)

#: (launcher, fault) run by the default suite; the other pairs are marked long.
DEFAULT = {("parallel", "kill0"), ("ddp_spawn", "hang"),
           ("lightning_ddp", "kill1")}  # torchrun: test_torchrun_distributed.py
CASES = [pytest.param(launcher, fault, marks=() if (launcher, fault) in DEFAULT else pytest.mark.long)
         for launcher in LAUNCHERS for fault in ("kill0", "kill1", "raise", "hang")]


@pytest.mark.parametrize("launcher, fault", CASES)
def test_every_survivor_prints_the_cause(launcher, fault, tmp_path):
    run = run_case(launcher, fault, tmp_path)
    for rank in run.survivors:
        lacks = missing(run, rank)
        if (launcher, fault) == ("lightning_ddp", "kill0") and lacks == ["lost: killed by SIGKILL"]:
            # rank 0's parent (here the harness, in real use the shell) reaped it before rank 1 read
            # its exit status: the signal is gone from the kernel (docs/limits.md); the rest must be there
            lacks = [] if "lost: process is gone (exit status not visible" in run.outputs[rank] else lacks
        assert not lacks, f"rank {rank}'s own output lacks {lacks}:\n{run.outputs.get(rank, '')[-4000:]}"
    if fault == "hang" and launcher == "torchrun":
        rank, block = torchrun_root_cause(run.parent)  # the hung rank's own error file wins
        assert rank == 1 and "RankHung" in block, run.parent[-3000:]
    elif fault in ("kill0", "kill1") and launcher in ("parallel", "ddp_spawn"):
        # the killed rank's liveness helper wrote torch's error file: the parent names rank, pid, signal
        f = run.failing
        assert f"rank {f} (pid {run.pids[f]} on " in run.parent and "killed by SIGKILL" in run.parent, \
            run.parent[-3000:]
    elif fault == "hang" and launcher in ("parallel", "ddp_spawn"):
        # the hung rank's reported exit wrote torch's error file: the parent raises its report
        assert "ProcessRaisedException" in run.parent and "-- Process 1 terminated with the following error" \
            in run.parent, run.parent[-3000:]
        tail = run.parent.split("-- Process 1 terminated")[-1]
        assert "RankHung: rank 1 (pid " in tail and " hung: " in tail, run.parent[-3000:]
