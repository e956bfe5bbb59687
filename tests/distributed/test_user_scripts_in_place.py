"""Recovering in place, in scripts shaped like the frameworks' own examples (issue 46, items 2, 5, 6).

``tests/programs/user_ignite_main.py`` is an Ignite script shaped like PyTorch-Ignite's cifar10 example:
``training(local_rank, config)`` under ``idist.Parallel``, an output folder named by a timestamp taken at
each call, ``setup_common_training_handlers`` (a ``Checkpoint`` with a ``DiskSaver`` in that folder, a
``PiecewiseLinear`` schedule), and the documented lines added. 2 ranks under torchrun (the folder made
at each call also at 4, ``long``), 64 iterations, a checkpoint every 20. Each case asserts where every rank's trainer started in the recovered attempt, the
batches it trained (the uninterrupted run's from there) and the final weights (``torch.equal``), and that
the line saying it carries on from live state is logged once it did.

* a folder made anew at each call on every rank, the script loading nothing (the example's
  ``resume_from=None``), rank 1 raising at iteration 45: the live state of iteration 44 is restored into
  the trainer's ``to_save`` (before: the log said it carried on from live state, and training started
  over at iteration 0);
* the folder made on rank 0 only (``latest_checkpoint(output_path)`` asked with different folders on the
  two ranks), rank 1 SIGKILLed at iteration 45, ``recover_in_place`` around the function that opens
  ``idist.Parallel``: rank 1's new process is sent rank 0's live state;
* the form the docs showed first, ``p.run(recover_in_place(training), cfg)`` inside ``idist.Parallel``:
  a WARNING on the first call names the line to change (a killed rank cannot be replaced there); a
  SIGKILL then ends the job naming it (``long``).

``test_lightning_in_place_keeps_one_logger_version``: a Lightning recovery in place (rank 1 raising, rank 0
SIGKILLed and replaced by its keeper, or lost and replaced by a spare, ``long``) logs on in the first
attempt's ``lightning_logs/version_0`` (before: a ``version_1`` per recovery), and a failure injected at
``iteration=37,epoch=1`` fires and is reported as ``(epoch 1, iteration 37)``: the injection and the
report name the same step and epoch (before, ``epoch=`` counted from 1 and the report from 0: this
injection never fired).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, kill_workers, run_ranks

SCRIPT = PROGRAMS / "programs" / "user_ignite_main.py"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            "--monitor-interval", "0.5"]
_reference: dict[int, tuple[Path, str]] = {}

pytestmark = pytest.mark.timeout(300)


def job(form: str, out: Path, env: dict[str, str], *, expect_ok: bool = True,
        world: int = 2) -> tuple[Path, int | None, str]:
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / f"{form}-1"
    launcher = [str(world) if arg == "2" else arg for arg in TORCHRUN]
    try:
        results = run_ranks(1, form, out, script=SCRIPT, launcher=launcher, deadline=150 * world // 2,
                            env={"PG_TIMEOUT_SEC": "20", "FTH_INJECT": "", **env})
    finally:
        kill_workers(run_dir, SCRIPT.name)  # torchrun's workers lead sessions of their own
    code, output = results[0].returncode, results[0].stderr
    if expect_ok:
        assert code == 0, f"torchrun exited {code}:\n{output[-5000:]}"
    return run_dir, code, output


def reference(tmp_path_factory, world: int = 2) -> tuple[Path, str]:
    """An uninterrupted run, in the form the docs showed first (its output is checked for the warning)."""
    if world not in _reference:
        run, _, output = job("documented", tmp_path_factory.mktemp("reference"), {}, world=world)
        _reference[world] = run, output
    return _reference[world]


def tries(run: Path, rank: int) -> dict[int, dict]:
    return {int(p.name[7:p.name.index("_")]): json.loads(p.read_text()) for p in run.glob(f"attempt*_rank{rank}.json")}


def trained(run: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run / f"batches{rank}.jsonl").read_text().splitlines()]


def assert_carried_on_from_live_state(run: Path, ref: Path, output: str, same_process: tuple[bool, ...]) -> None:
    for rank in range(len(same_process)):
        seen = tries(run, rank)
        assert set(seen) == {0, 1}, f"rank {rank}: attempts {sorted(seen)}\n{output[-4000:]}"
        assert (seen[0]["pid"] == seen[1]["pid"]) == same_process[rank], (rank, seen)
        assert seen[1]["done"] and seen[1]["iteration"] == 64 and not seen[0].get("done"), seen
        assert seen[1]["start_iteration"] == 44, f"rank {rank} started at {seen[1]['start_iteration']}, not 44"
        rest = [(e["step"], e["idx"]) for e in trained(run, rank) if e["attempt"] == 1]
        assert rest == [(e["step"], e["idx"]) for e in trained(ref, rank)[44:]], f"rank {rank}: other batches"
    final, expected = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    for key in expected:
        assert torch.equal(final[key], expected[key]), f"{key} differs from the uninterrupted run's"
    assert "is held for the next call" in output


def assert_folders_side_by_side(run: Path, ranks: int) -> None:
    """Each attempt's folder was made in the base folder (``config["output_path"]`` as the script was
    called), not inside the previous attempt's, which the example's ``config["output_path"] = ...``
    did when every attempt was given the same dict."""
    for rank in range(ranks):
        made = [Path(tries(run, rank)[a]["folder"]) for a in (0, 1)]
        assert made[0].parent == made[1].parent == run / "output", (rank, made)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])
def test_a_folder_made_at_each_call_carries_on_from_live_state(world, tmp_path, tmp_path_factory):
    """Every rank names a new timestamped folder at each call and loads nothing itself: the live state
    reaches the trainer's ``to_save`` all the same."""
    ref, ref_output = reference(tmp_path_factory, world)
    run, _, output = job("documented", tmp_path, {"FOLDER": "every-rank", "RESUME": "none",
                                                  "FTH_INJECT": "raise@rank=1,iteration=45"}, world=world)
    folders = {tries(run, 0)[a]["folder"] for a in (0, 1)}
    assert len(folders) == 2, folders  # a new folder in the recovered attempt: no checkpoint in it
    assert_folders_side_by_side(run, world)
    assert_carried_on_from_live_state(run, ref, output, (True,) * world)
    # the form the docs showed first: warned once per rank, with the line to change
    assert ref_output.count("recover_in_place was called inside a process group that exists already") == world
    assert "'recover_in_place(main, ...)(cfg)' where main(cfg) runs 'with idist.Parallel(backend=...) as p: " \
           "p.run(training, cfg)'" in ref_output
    assert output.count("carries on from live state, iteration 44 (restored into the trainer's Checkpoint objects "
                        "(trainer, model, optimizer, lr_scheduler, loader)): no step computed twice") == world, \
        output[-4000:]


def test_a_folder_only_rank_0_knows_and_a_killed_rank_carry_on_from_live_state(tmp_path, tmp_path_factory):
    """Rank 0 makes the folder, rank 1 keeps the base one, both ask ``latest_checkpoint(trainer)`` (the
    documented line: the folder of rank 0's ``Checkpoint`` serves); rank 1 is SIGKILLed, its keeper's
    new process receives rank 0's live state (the form with ``recover_in_place`` around the function
    that opens ``idist.Parallel``)."""
    ref, _ = reference(tmp_path_factory)
    run, _, output = job("around", tmp_path, {"FOLDER": "rank-0", "RESUME": "trainer",
                                              "FTH_INJECT": "kill@rank=1,iteration=45"})
    assert_carried_on_from_live_state(run, ref, output, (True, False))
    assert_folders_side_by_side(run, 1)
    assert "sent from rank 0 to rank 1" in output
    assert [Path(tries(run, r)[1]["resumed_from"]).name for r in (0, 1)] == ["live-state-step=44.pt"] * 2
    assert output.count("carries on from live state, iteration 44 (loaded by the script from live-state-step=44.pt)") \
        == 2, output[-4000:]
    assert "recover_in_place was called inside a process group that exists already" not in output


@pytest.mark.long
def test_the_documented_form_warns_and_a_killed_rank_ends_the_job_naming_it(tmp_path):
    """``p.run(recover_in_place(training), cfg)`` inside ``idist.Parallel``: warned at the first call; a
    SIGKILL of rank 1 then ends the job (no process can replace it), naming it."""
    run, code, output = job("documented", tmp_path, {"FTH_INJECT": "kill@rank=1,iteration=45"}, expect_ok=False)
    assert code not in (0, None), output[-4000:]
    assert output.count("recover_in_place was called inside a process group that exists already") == 2
    assert "not recovered in place: a rank was lost" in output, output[-4000:]


@pytest.mark.parametrize("inject", ["raise@rank=1,iteration=37,epoch=1", "kill@rank=0,iteration=37,epoch=1",
                                    pytest.param("lose@rank=0,iteration=37,epoch=1", marks=pytest.mark.long)])
def test_lightning_in_place_keeps_one_logger_version(inject, tmp_path):
    """The default logger and ``ModelCheckpoint``, ``fit(ckpt_path=None)``, a failure in the 37th training
    batch, in epoch 1 (Lightning's ``current_epoch``), after the first checkpoint (epoch 0's end, step 32):
    rank 1 raising (reported as epoch 1, iteration 37), rank 0 SIGKILLed (its keeper's new process,
    which ran no teardown, takes the first attempt's versions from the store), or rank 0 lost for good
    and a spare (a third launched process) taking its seat the same way. The recovered attempt's
    ``fit`` is given the live state of global step 36 although the script passed no path; its logger
    writes on in ``lightning_logs/version_0`` (no ``version_1``), whose ``metrics.csv`` keeps the first
    attempt's rows, and its ``ModelCheckpoint`` replaces step 32's file there with step 64's (before, for
    rank 0 killed: a ``version_1`` holding the rows and checkpoints after the recovery, ``best_k_models``
    dropped). Its plain ``DataLoader`` starts epoch 1 over: the line saying it carries on from
    live state says so (before: "no step computed twice")."""
    script = PROGRAMS / "programs" / "user_lightning_main.py"
    out = tmp_path / "job"
    out.mkdir()
    try:
        spares = int(inject.startswith("lose"))
        launcher = [str(2 + spares) if arg == "2" else arg for arg in TORCHRUN]
        results = run_ranks(1, "", out, script=script, launcher=launcher, deadline=180,
                            env={"FTH_INJECT": inject, "SPARES": str(spares)})
    finally:
        kill_workers(out / "user_lightning_main-1", script.name)
    run, code, output = out / "user_lightning_main-1", results[0].returncode, results[0].stderr
    assert code == 0, f"torchrun exited {code}:\n{output[-5000:]}"
    killed = not inject.startswith("raise")
    if not killed:
        assert "rank 1 failed in 'train' (epoch 1, iteration 37)" in output, output[-4000:]
    for rank in (0, 1):
        seen = tries(run, rank)
        assert set(seen) == {0, 1} and (seen[0]["pid"] == seen[1]["pid"]) == (not killed or rank == 1), seen
        assert seen[1]["start_step"] == 36 and seen[1]["done"] and seen[1]["step"] == 64, seen
    # its plain DataLoader starts epoch 1 over (Lightning's own check warns): not "no step computed twice"
    assert output.count("carries on from live state, global step 36 (restored through the trainer's "
                        "fit(ckpt_path=...)): resumed at that global step, but the data of the resumed epoch restarts "
                        "from its beginning (DataLoader has no state_dict/load_state_dict): Lightning draws its "
                        "remaining 28 steps from the start of the epoch, not the batches an uninterrupted run "
                        "trains") == 2, output[-4000:]
    assert "no step computed twice" not in output
    versions = sorted(p.name for p in (run / "lightning_logs").iterdir())
    assert versions == ["version_0"], versions
    assert tries(run, 0)[1]["log_dir"] == tries(run, 0)[0]["log_dir"]
    assert sorted(p.name for p in (run / "lightning_logs" / "version_0" / "checkpoints").iterdir()) \
        == ["epoch=1-step=64.ckpt"]
    assert "dirpath has changed" not in output
    rows = (run / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    steps = sorted({int(line.split(",")[rows[0].split(",").index("step")]) for line in rows[1:]})
    assert steps[0] < 30 and steps[-1] >= 60, steps  # both attempts' rows
