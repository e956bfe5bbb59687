"""A spare takes training rank 0's place, on one host: ``torchrun --standalone --nproc-per-node 3
--max-restarts 0``, 2 training ranks and 1 spare (``recover_in_place(spares=1)``, ``resume_main.py``'s
seeded Ignite training with ``SPARES=1``, as ``test_spares.py``).

Rank 0 has roles of its own in a recovery (it decides, once every rank is in; it tells the spares
that the training ended; it deletes the keys of the recovery before). Here rank 0 is the one lost:
SIGKILLed at iteration 37 with no process to come back in (``FTH_INJECT=lose@rank=0,...``, its
keeper told not to replace it, as if its host were gone; under ``--standalone`` the store is the
agent's, which outlives it). The spare takes rank 0's place and its roles: rank 1 claims it, the
spare decides the recovery, receives rank 1's live state, and the run carries on at iteration 37
(nothing computed twice) to the weights of the uninterrupted 2-rank run, bit for bit, which the spare
writes as rank 0; every process exits 0. Also when the failure reaches rank 1 between the optimizer
update of iteration 36 and that iteration's end (a race of the watchdog's delivery): the end-of-iteration
check raises it only after live state marked the iteration (before, 1 run in 4 to 7 went back to the
newest checkpoint: 'no rank holds live state').

The same case across hosts, rank 0's host lost whole, needs the store on a host of its own
(``test_multihost_store_host.py``).
"""

from __future__ import annotations

import pytest

from test_recover_in_place import assert_recovered_exactly, recomputed, tries
from test_spares import SPARE, reference, torchrun


@pytest.mark.timeout(300)
def test_rank_0_lost_with_no_keeper_is_replaced_by_the_spare_which_takes_its_roles(tmp_path, tmp_path_factory):
    ref = reference(tmp_path_factory)
    run, _, output = torchrun(tmp_path, {**SPARE, "FTH_INJECT": "lose@rank=0,iteration=37"})
    assert "the next call starts from what it loads itself" not in output
    assert "is held for the next call" in output, output[-4000:]
    assert_recovered_exactly(run, ref, "ignite", same_process=(False, True), live=True)
    assert recomputed(run, failing=0) == 0
    assert output.count("sent from rank 1 to rank 0: a spare took its place (it holds no state)") == 2, output[-3000:]
    spare, lost = tries(run, 0)[1], tries(run, 0)[0]
    assert spare["pid"] != lost["pid"]
    assert (spare["dist_rank"], spare["dist_world"], spare["env_world"], spare["spares_left"]) == (0, 2, 2, 0), spare
    assert (spare["local_rank"], spare["local_world"]) == ("0", "2"), spare  # on the lost rank's host: its names
    assert tries(run, 1)[1]["spares_left"] == 0
    assert "lost for good (FTH_INJECT lose): not replaced" in output
    assert "[rank 1] rank 0 was lost with no keeper to replace it: spare launched rank 2 takes its place (0 spares " \
           "left after it)" in output, output[-4000:]
    line = next(line for line in output.splitlines() if "took the place of lost rank 0" in line)
    assert line.startswith("[rank 0] spare launched rank 2 on host ") and "(launched rank 0 on host " in line, line
    took = float(line.split("): ")[-1].split(" s from the failure")[0])
    assert 0 < took < 20, line
