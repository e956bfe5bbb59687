"""Spare ranks under ``torchrun --standalone --nproc-per-node 3 --max-restarts 0``: 2 training ranks
and 1 spare (``recover_in_place(spares=1)``, ``resume_main.py``'s seeded Ignite training with
``SPARES=1``: 50 iterations, a checkpoint every 10, ``FaultTolerance`` attached).

* healthy: the spare never calls the training function, which sees a world of 2 (``dist`` and the
  environment); the weights are an uninterrupted 2-rank run's; every process exits 0;
* rank 1 lost at iteration 37 with no process to come back in (``FTH_INJECT=lose@...``: SIGKILLed,
  and its keeper told not to replace it, as if its host were gone; one host's torchrun ends the whole
  job when one of its workers dies, so the keeper stays, idle): the spare takes rank 1, receives
  rank 0's live state, and the run carries on at iteration 37: nothing computed twice, the weights
  of the uninterrupted 2-rank run bit for bit, every process exits 0, one log line names the lost
  rank, the spare and the time;
* two of 3 training ranks lost at once (5 launched, 2 spares; ``long``): each gets a spare, both
  receive rank 0's live state, and the weights are an uninterrupted 3-rank run's;
* a second rank lost with no spare left ends the job with that cause;
* the spare that took rank 0's seat is kept like every training rank: a SIGKILL of its process
  later is replaced in place by its keeper, exact;
* ``spares`` that leaves no training rank ends every process at start with the error naming it.

* a killed rank whose keeper lives is replaced by its keeper: no spare spent.

torchrun restarts nothing (``--max-restarts 0``): an attempt 1 can only be a recovery in place. The
lost rank runs under Lightning too (``long``: ``make test-long``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, run_ranks
from test_recover_in_place import assert_recovered_exactly, recomputed, tries, trained

SCRIPT = PROGRAMS / "resume_main.py"
ENV = {"PG_TIMEOUT_SEC": "20", "EPOCHS": "1", "EVERY": "10", "FTH_INJECT": ""}
SPARE = {"INPLACE": "2", "SPARES": "1"}
_reference: dict[tuple[str, int], Path] = {}


def kill_launched(run_dir: Path) -> None:
    """Kill, by pid, each launched process of the job still running (each leads the process group
    torchrun made for it: its keeper's child and DataLoader workers go with it)."""
    for path in run_dir.glob("process_launched*.json"):
        try:
            info = json.loads(path.read_text())
            with open(f"/proc/{info['pid']}/cmdline", "rb") as f:
                if b"resume_main.py" not in f.read():
                    continue
            os.killpg(int(info["pgid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            continue


def torchrun(out: Path, env: dict[str, str], *, nproc: int = 3, expect_ok: bool = True, framework: str = "ignite",
             deadline: float = 150):
    out.mkdir(parents=True, exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                "--monitor-interval", "0.5"]
    run_dir = out / f"{framework}-1"
    try:
        results = run_ranks(1, framework, out, script=SCRIPT, launcher=launcher, deadline=deadline, env={**ENV, **env})
    finally:
        kill_launched(run_dir)
    code, output = results[0].returncode, results[0].stderr
    if expect_ok:
        assert code == 0, f"torchrun exited {code}:\n{output[-4000:]}"
    return run_dir, code, output


def reference(tmp_path_factory, framework: str = "ignite", world: int = 2) -> Path:
    """The uninterrupted run of ``world`` ranks, without spares."""
    if (framework, world) not in _reference:
        _reference[framework, world] = torchrun(tmp_path_factory.mktemp(f"ref-{world}-ranks-{framework}"), {},
                                                nproc=world, framework=framework)[0]
    return _reference[framework, world]


def assert_same_weights(run: Path, ref: Path) -> None:
    final, expected = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    for key in expected:
        assert torch.equal(final[key], expected[key]), f"{key} differs from the uninterrupted 2-rank run"


@pytest.mark.timeout(300)
def test_a_healthy_run_with_a_spare_trains_on_2_ranks_and_the_spare_never_calls_the_function(tmp_path,
                                                                                             tmp_path_factory):
    ref = reference(tmp_path_factory)
    run, _, output = torchrun(tmp_path, SPARE)
    assert not list(run.glob("attempt*_rank2.json")), "the spare called the training function"
    for rank in (0, 1):
        seen = tries(run, rank)
        assert set(seen) == {0} and seen[0]["done"], seen
        first = seen[0]
        assert (first["dist_rank"], first["dist_world"], first["env_world"]) == (rank, 2, 2), first
        assert first["local_world"] == "2", first  # the training ranks of this host, not the 3 launched
        assert first["spares_left"] == 1, first
        assert [(e["step"], e["idx"]) for e in trained(run, rank)] == [(e["step"], e["idx"]) for e in trained(ref, rank)]
    assert_same_weights(run, ref)
    spare = json.loads((run / "process_launched2.json").read_text())["pid"]
    assert not any(t["pid"] == spare for r in (0, 1) for t in tries(run, r).values())
    assert json.loads((run / f"returned_pid{spare}.json").read_text())["result"] is None  # it was told: it ended
    assert len(list(run.glob("returned_pid*.json"))) == 3  # every launched process's call returned


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["ignite", pytest.param("lightning", marks=pytest.mark.long)])
def test_a_rank_lost_with_no_keeper_is_replaced_by_the_spare_and_the_run_stays_exact(framework, tmp_path,
                                                                                   tmp_path_factory):
    ref = reference(tmp_path_factory, framework)
    run, _, output = torchrun(tmp_path, {**SPARE, "FTH_INJECT": "lose@rank=1,iteration=37"}, framework=framework)
    assert_recovered_exactly(run, ref, framework, same_process=(True, False), live=True)
    assert recomputed(run) == 0
    spare = tries(run, 1)[1]
    assert spare["pid"] != tries(run, 1)[0]["pid"]
    if framework == "ignite":  # Lightning makes its group in fit, after the note
        assert (spare["dist_rank"], spare["dist_world"]) == (1, 2), spare
    assert (spare["env_world"], spare["spares_left"]) == (2, 0), spare
    assert (spare["local_rank"], spare["local_world"]) == ("1", "2"), spare  # on the lost rank's host: its names
    assert tries(run, 0)[1]["spares_left"] == 0
    assert "lost for good (FTH_INJECT lose): not replaced" in output
    assert "[rank 0] rank 1 was lost with no keeper to replace it: spare launched rank 2 takes its place (0 spares " \
           "left after it)" in output
    line = next(line for line in output.splitlines() if "took the place of lost rank 1" in line)
    assert "spare launched rank 2 on host " in line and "(launched rank 1 on host " in line, line
    took = float(line.split("): ")[-1].split(" s from the failure")[0])
    assert 0 < took < 20, line
    assert output.count("sent from rank 0 to rank 1: a spare took its place (it holds no state)") == 2, output[-3000:]


@pytest.mark.timeout(300)
def test_a_killed_rank_whose_keeper_lives_is_replaced_by_its_keeper_and_no_spare_is_spent(tmp_path, tmp_path_factory):
    ref = reference(tmp_path_factory)
    run, _, output = torchrun(tmp_path, {**SPARE, "FTH_INJECT": "kill@rank=1,iteration=37"})
    assert_recovered_exactly(run, ref, "ignite", same_process=(True, False), live=True)
    assert recomputed(run) == 0
    assert "killed by SIGKILL: starting its replacement" in output
    assert "took the place of lost rank" not in output
    assert all(tries(run, rank)[1]["spares_left"] == 1 for rank in (0, 1))
    spare = json.loads((run / "process_launched2.json").read_text())["pid"]
    assert json.loads((run / f"returned_pid{spare}.json").read_text())["result"] is None


@pytest.mark.timeout(300)
def test_a_spare_that_took_a_lost_ranks_seat_is_kept_and_a_later_sigkill_of_it_is_replaced_in_place(
        tmp_path, tmp_path_factory):
    """Rank 0 lost at iteration 27 (its host gone: no keeper replaces it): the spare takes its seat
    and trains under a keeper of its own, as every training rank does. At iteration 40 the seat's
    process is SIGKILLed: the spare's keeper (torchrun's worker, which lives on) starts a replacement
    that joins the recovery, and the run carries on at iteration 40, nothing computed twice, to the
    uninterrupted 2-rank run's weights; every process exits 0. (Before, the spare trained in
    torchrun's worker itself: the kill ended the job.)"""
    ref = reference(tmp_path_factory)
    run, _, output = torchrun(tmp_path, {**SPARE, "FTH_INJECT": "lose@rank=0,iteration=27; "
                                                                "kill@rank=0,iteration=40,attempt=1"})
    assert_recovered_exactly(run, ref, "ignite", attempts=2, same_process=(False, True), live=True)
    assert recomputed(run, 2, failing=0) == 0
    seat = tries(run, 0)
    spare = json.loads((run / "process_launched2.json").read_text())["pid"]
    assert len({seat[a]["pid"] for a in (0, 1, 2)} | {spare}) == 4, seat  # lost, the spare's child, its replacement
    assert "[rank 1] rank 0 was lost with no keeper to replace it: spare launched rank 2 takes its place" in output
    assert output.count("took the place of lost rank 0") == 1, output[-4000:]  # the replacement is its keeper's
    assert f"the training process of rank 0 (pid {seat[1]['pid']}) killed by SIGKILL: starting its replacement, " \
           "which joins the recovery of attempt 1" in output, output[-4000:]
    assert output.count("sent from rank 1 to rank 0: its process was replaced (its state ended with it)") == 2, \
        output[-4000:]
    assert seat[2]["spares_left"] == 0 and tries(run, 1)[2]["spares_left"] == 0
    assert json.loads((run / f"returned_pid{spare}.json").read_text())["pid"] == spare  # its call returned, in its keeper
    assert len(list(run.glob("returned_pid*.json"))) == 3  # every launched process's call returned


@pytest.mark.timeout(300)
@pytest.mark.long
def test_two_ranks_lost_at_once_are_replaced_by_two_spares_and_the_run_stays_exact(tmp_path, tmp_path_factory):
    """5 launched: 3 training ranks and 2 spares; ranks 1 and 2 are lost at the same iteration. Each
    lost rank gets its own spare (in launched order), both receive rank 0's live state, and the run
    ends with the weights of an uninterrupted 3-rank run."""
    ref = reference(tmp_path_factory, world=3)
    run, _, output = torchrun(tmp_path, {"INPLACE": "2", "SPARES": "2",
                                         "FTH_INJECT": "lose@rank=1,iteration=27; lose@rank=2,iteration=27"}, nproc=5)
    assert_recovered_exactly(run, ref, "ignite", same_process=(True, False, False), live=True)
    assert recomputed(run) == 0
    took = {}
    for lost in (1, 2):
        line = next(line for line in output.splitlines() if f"took the place of lost rank {lost}" in line)
        took[lost] = line.split("spare launched rank ")[1].split(" ")[0]
        assert (tries(run, lost)[1]["env_world"], tries(run, lost)[1]["spares_left"]) == (3, 0)
    assert sorted(took.values()) == ["3", "4"], took  # one spare each, none twice
    assert tries(run, 0)[1]["spares_left"] == 0
    assert "was lost too, with no keeper to replace it: spare launched rank" in output, output[-4000:]


@pytest.mark.timeout(300)
def test_a_second_rank_lost_with_no_spare_left_ends_the_job_with_the_cause(tmp_path):
    run, code, output = torchrun(tmp_path, {**SPARE, "FTH_INJECT": "lose@rank=1,iteration=37; "
                                                                   "lose@rank=0,iteration=45,attempt=1"},
                                 expect_ok=False)
    assert code != 0
    assert "took the place of lost rank 1" in output  # the first loss was recovered by the spare
    assert set(tries(run, 1)) == {0, 1} and not tries(run, 1)[1].get("done")
    assert "rank 0 was lost with no keeper to replace it, and no spare is left (spares=1, all taken)" in output, \
        output[-4000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])
def test_a_seat_lost_twice_gets_a_spare_each_time_and_the_run_stays_exact(world, tmp_path, tmp_path_factory):
    """``world`` training ranks and 2 spares. Rank 1 is lost at iteration 27 (13 at 4 ranks, which run
    25 iterations; spare launched rank ``world`` takes its seat), then the process in that seat is
    lost in turn at iteration 40 (20): the next spare takes it, the run carries on there with nothing
    computed twice and the uninterrupted run's weights, and the first spare, whose process was lost,
    stays until the job ends and exits 0. Before, the first spare read the order that had given it
    the seat as the job's end, exited 1, and torchrun ended every rank (seen in ``bench/goodput.py``,
    one fault every 20 s at 4 ranks)."""
    ref = reference(tmp_path_factory, world=world)
    first, second = (27, 40) if world == 2 else (13, 20)
    run, _, output = torchrun(tmp_path, {"INPLACE": "2", "SPARES": "2", "FTH_INJECT": f"lose@rank=1,iteration={first}; "
                                         f"lose@rank=1,iteration={second},attempt=1"}, nproc=world + 2)
    assert_recovered_exactly(run, ref, "ignite", attempts=2, same_process=(True, False), live=True)
    assert recomputed(run, 2) == 0
    took = [line.split("spare launched rank ")[1].split(" ")[0] for line in output.splitlines()
            if "took the place of lost rank 1" in line]
    assert took == [str(world), str(world + 1)], output[-4000:]  # one spare each time, in launched order
    assert f"launched rank {world}: the job ended" not in output, output[-4000:]
    assert tries(run, 0)[2]["spares_left"] == 0


@pytest.mark.timeout(120)
def test_spares_that_leave_no_training_rank_end_every_process_at_start_naming_it(tmp_path):
    run, code, output = torchrun(tmp_path, {"INPLACE": "2", "SPARES": "3"}, expect_ok=False)
    assert code != 0
    assert ("ValueError: recover_in_place(spares=3): the job was launched with 3 ranks (WORLD_SIZE=3), so spares "
            "must be from 0 to 2 (at least 1 rank trains)") in output
    assert not list(run.glob("attempt*.json"))
