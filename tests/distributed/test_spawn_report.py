"""Under ``mp.spawn``-family launchers (Ignite's ``idist.Parallel``, Lightning's ``ddp_spawn``), whose
parent SIGTERMs every other rank as soon as one exits, the surviving rank's own output names the
cause before its process ends: the failing rank and its pid with ``killed by SIGKILL``, its exception
with the remote traceback, or ``RankHung`` with the hung line of its stack. Real 2-rank gloo DDP
trainings (``tests/spawn_cases.py``), each rank's stdout/stderr in a file of its own.

The default suite runs three cases (about 13 s each on an idle machine; ``ddp_spawn`` with rank 1
SIGKILLed is also ``test_watchdog_distributed.py::test_sigkilled_peer_in_a_lightning_fit``);
``make test-long`` runs every launcher x fault; ``make bench-spawn`` counts them over 20 runs each.
"""

from __future__ import annotations

import pytest

from spawn_cases import missing, run_case

pytestmark = pytest.mark.timeout(200)

#: (launcher, fault) run by the default suite; the other pairs are marked long.
DEFAULT = {("parallel", "kill0"), ("ddp_spawn", "hang")}  # a ddp_spawn raise: test_lightning_distributed too
CASES = [pytest.param(launcher, fault, marks=() if (launcher, fault) in DEFAULT else pytest.mark.long)
         for launcher in ("parallel", "ddp_spawn") for fault in ("kill0", "kill1", "raise", "hang")]


@pytest.mark.parametrize("launcher, fault", CASES)
def test_every_survivor_prints_the_cause(launcher, fault, tmp_path):
    run = run_case(launcher, fault, tmp_path)
    for rank in run.survivors:
        lacks = missing(run, rank)
        assert not lacks, f"rank {rank}'s own output lacks {lacks}:\n{run.outputs.get(rank, '')[-4000:]}"
    if fault == "hang":
        # the hung rank's reported exit wrote torch's error file: the parent raises its report
        assert "ProcessRaisedException" in run.parent and "-- Process 1 terminated with the following error" \
            in run.parent, run.parent[-3000:]
        tail = run.parent.split("-- Process 1 terminated")[-1]
        assert "RankHung: rank 1 (pid " in tail and " hung: " in tail, run.parent[-3000:]
