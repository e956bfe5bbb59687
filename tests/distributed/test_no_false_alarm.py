"""No false alarm: healthy trainings on 8 ranks, on a 2-core machine with every core kept busy by
extra processes, end with every rank finished and nothing declared (no rank lost, silent or hung,
no store lost). On 66fef79 a rank declared the store's host lost after a few seconds of slow
connects and ended the job. ``bench/soak.py`` runs the same many times (the pass count)."""

from __future__ import annotations

import pytest

from launch import cpu_hogs, healthy_run

WORLD, ITERATIONS = 8, 60  # 2 epochs of 30


@pytest.mark.timeout(420)
@pytest.mark.parametrize("framework", ["ignite", pytest.param("lightning", marks=pytest.mark.long)])  # suite time: 8 Lightning ranks take ~2.5 min here
def test_a_healthy_8_rank_training_on_busy_cores_is_never_declared_failed(framework, tmp_path):
    with cpu_hogs(2):
        run = healthy_run(framework, WORLD, tmp_path / framework, deadline=360)
    assert run.returncode == 0, run.output[-5000:]
    assert run.declarations == [], "\n".join(run.declarations[:20])
    assert sorted(run.ranks) == list(range(WORLD)), run.output[-3000:]
    assert {r: v.get("finished") for r, v in run.ranks.items()} == {r: ITERATIONS for r in range(WORLD)}


@pytest.mark.long  # 8 Lightning ranks, about 3 min here
@pytest.mark.timeout(420)
def test_a_healthy_8_rank_lightning_job_with_checkpoints_and_validations_between_steps_is_never_declared_hung(
        tmp_path):
    """``hang_timeout="auto"`` with the rule shortened (no deadline under 2 s, judged from the 6th step)
    on busy cores, a ``ModelCheckpoint`` and a validation every 5 steps: each piece of work between two
    steps is judged by its own kind's deadline and the next batch's start is a step again, so no rank
    is declared hung (the beat of a step after a checkpoint, 1f66fb8, changed which deadline applies
    there)."""
    env = {"SOAK_HANG_TIMEOUT": "auto", "SOAK_OTHER_WORK_EVERY": "5", "FTH_AUTO_HANG_FLOOR_SEC": "2",
           "FTH_AUTO_HANG_WARMUP": "5"}
    with cpu_hogs(2):
        run = healthy_run("lightning", WORLD, tmp_path / "lightning", deadline=360, env=env)
    assert run.returncode == 0, run.output[-5000:]
    assert run.declarations == [], "\n".join(run.declarations[:20])
    assert {r: v.get("finished") for r, v in run.ranks.items()} == {r: ITERATIONS for r in range(WORLD)}
    written = sorted((tmp_path / "lightning" / "checkpoints").glob("*.ckpt"))
    assert len(written) == ITERATIONS // 5, written  # the other work happened: a checkpoint every 5 steps
