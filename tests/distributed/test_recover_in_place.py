"""Recovering in place under ``torchrun --max-restarts 0``: the same processes re-form the group and
train on from their live state at the last completed iteration, or from the newest checkpoint where
live state cannot serve (``resume_main.py`` with ``INPLACE=<max_restarts>``).

2 ranks, 50 iterations (one epoch), a checkpoint every 10 (or, ``EVERY=1000``, none at all),
``FaultTolerance`` attached, rank 1 failing at iteration 37 in the first attempt (``FTH_INJECT``'s
default ``attempt=0``). torchrun restarts nothing (``--max-restarts 0``), so an attempt 1 can only be
a recovery in place. Every case asserts what every rank saw: the pids of both attempts (the same
processes), where attempt 1 resumed (live state: iteration 36, none computed twice; a checkpoint:
iteration 30), the batches it trained (exactly the uninterrupted run's from there), the final weights
(``torch.equal``), and for the cases that must not recover, the cause each rank ended with.

Default suite: Ignite raising (live state), a SIGKILLed rank replaced (live state sent to its new
process), 6 recoveries in one job, a hang inside a step
that swallows every exception, Lightning failing just after an epoch's last batch (a user's shape:
validation, a scheduler, a plain DataLoader); the rest is ``long`` (``make test-long``): Lightning, no
checkpoint at all, hangs, ``FTH_LIVE_STATE=0``, 20 recoveries, two recoveries, a repeat,
``max_restarts`` spent, ``replace_dead=False``, persistent workers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, kill_workers, run_ranks, torchrun_root_cause

SCRIPT = PROGRAMS / "resume_main.py"
ENV = {"PG_TIMEOUT_SEC": "20", "EPOCHS": "1", "EVERY": "10", "FTH_INJECT": ""}
_reference: dict[tuple, Path] = {}
#: Each training step also draws from Python's ``random`` and numpy's global RNG, which the training
#: function seeds as it starts (``seed_everything``'s way): exact only if live state puts them back too.
PY_RANDOM = {"PY_RANDOM": "1"}


def torchrun(framework: str, out: Path, env: dict[str, str], *, max_restarts: int = 0, expect_ok: bool = True,
             nproc: int = 2):
    out.mkdir(parents=True, exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "--max-restarts",
                str(max_restarts), "--monitor-interval", "0.5"]
    run_dir = out / f"{framework}-1"
    try:
        results = run_ranks(1, framework, out, script=SCRIPT, launcher=launcher, deadline=150, env={**ENV, **env})
    finally:
        kill_workers(run_dir)  # torchrun's workers have sessions of their own
    code, output = results[0].returncode, results[0].stderr
    if expect_ok:
        assert code == 0, f"torchrun exited {code}:\n{output[-4000:]}"
    return run_dir, code, output


def reference(framework: str, tmp_path_factory, env: dict[str, str] | None = None) -> Path:
    key = (framework, *sorted((env or {}).items()))
    if key not in _reference:
        _reference[key] = torchrun(framework, tmp_path_factory.mktemp(f"ref-{framework}"), env or {})[0]
    return _reference[key]


def tries(run_dir: Path, rank: int) -> dict[int, dict]:
    return {int(p.name[7:p.name.index("_")]): json.loads(p.read_text()) for p in run_dir.glob(f"attempt*_rank{rank}.json")}


def trained(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"batches{rank}.jsonl").read_text().splitlines()]


def recomputed(run: Path, attempt: int = 1, failing: int = 1) -> int:
    """Iterations trained twice by the recovery into ``attempt``: the ``failing`` rank fails as its
    iteration starts, before it traces it, so the last iteration it traced in the attempt before
    completed; ``attempt`` starts after its ``start_iteration``."""
    before = [e["step"] for e in trained(run, failing) if e["attempt"] == attempt - 1]
    return before[-1] - tries(run, failing)[attempt]["start_iteration"]


def assert_recovered_exactly(run: Path, ref: Path, framework: str, attempts: int = 1,
                             same_process: tuple[bool, ...] = (True, True), live: bool = False) -> None:
    """``live``: the last attempt carried on from the live state of the last completed iteration
    (none trained twice); else from the newest checkpoint (at most its interval trained twice).
    ``same_process``: for each training rank, whether all its attempts ran in one process."""
    for rank in range(len(same_process)):
        seen = tries(run, rank)
        assert set(seen) == set(range(attempts + 1)), f"rank {rank}: attempts {sorted(seen)}"
        pids = {t["pid"] for t in seen.values()}
        assert (len(pids) == 1) == same_process[rank], f"rank {rank}: pids of its attempts {pids}"
        assert seen[attempts]["done"] and not any(seen[a].get("done") for a in range(attempts))
        last = seen[attempts]
        # a process that saved the newest checkpoint reads it from its memory; a replacement from the
        # file; live state is in memory everywhere (a replacement's was sent to it)
        assert last["in_memory"] == (same_process[rank] or live), last
        assert last["first_step"] == last["start_iteration"] + 1, last
        name = Path(last["resumed_from"]).name
        got, want = trained(run, rank), trained(ref, rank)
        before = [e["step"] for e in got if e["attempt"] == attempts - 1]
        if live:  # the last iteration completed (a peer may have started the next one, and failed in it)
            assert name == f"live-state-step={last['start_iteration']}.pt", name
            assert before[-1] - last["start_iteration"] in (0, 1), (before[-1], last)
        else:
            assert last["start_iteration"] % 10 == 0, last
            assert name in ((f"checkpoint_{last['start_iteration']}.pt",) if framework == "ignite"
                            else ("last.ckpt", f"epoch=0-step={last['start_iteration']}.ckpt")), name
            assert before[-1] - last["start_iteration"] <= 10, "recomputed more than the checkpoint interval"
        rest = [(e["step"], e["idx"]) for e in got if e["attempt"] == attempts]
        assert rest == [(e["step"], e["idx"]) for e in want[last["start_iteration"]:]]
    final, expected = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    for key in expected:
        assert torch.equal(final[key], expected[key]), f"{framework}: {key} differs from the uninterrupted run"


UNIT = {"ignite": "iteration", "lightning": "global step"}
LIVE_CASES = [
    pytest.param("ignite", "10", id="ignite-every-10"),
    pytest.param("ignite", "1000", id="ignite-no-checkpoint", marks=pytest.mark.long),
    pytest.param("lightning", "10", id="lightning-every-10", marks=pytest.mark.long),
    pytest.param("lightning", "1000", id="lightning-no-checkpoint", marks=pytest.mark.long),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework, every", LIVE_CASES)
def test_a_raise_recovers_in_place_from_live_state_exactly(framework, every, tmp_path, tmp_path_factory):
    """No iteration trained twice, whatever the checkpoint interval (``EVERY=1000``: no checkpoint at
    all), and the uninterrupted run's weights, bit for bit, with steps that draw from Python's ``random``
    and numpy's global RNG (``PY_RANDOM``; before they were put back with torch's, the next call's
    ``random.seed``/``numpy.random.seed`` made the steps after the failure draw other numbers)."""
    ref = reference(framework, tmp_path_factory, PY_RANDOM)
    run, _, output = torchrun(framework, tmp_path, {**PY_RANDOM, "INPLACE": "2", "EVERY": every,
                                                    "FTH_INJECT": "raise@rank=1,iteration=37"})
    assert recomputed(run) == 0  # before live state: 6 (from the checkpoint of 30), 36 without a checkpoint
    assert_recovered_exactly(run, ref, framework, live=True)
    for rank in (0, 1):  # one log line per recovery, on every rank, naming the cause, the attempt, the state
        assert f"[rank {rank}] recovering in place, attempt 1 (max_restarts=2), after rank 1 failed in train: " \
               "InjectedFault" in output
    assert output.count(f"live state, {UNIT[framework]} 36 (each rank's own), is held for the next call") == 2
    # told once the next call's loop started from it (the script loads the name latest_checkpoint gave)
    assert output.count(f"carries on from live state, {UNIT[framework]} 36 (") == 2, output[-3000:]
    if framework == "ignite":  # the first attempt's group, destroyed by the recovery, is freed (its threads, sockets)
        assert [tries(run, rank)[1]["earlier_groups_alive"] for rank in (0, 1)] == [0, 0]


#: A user's shape (resume_main.py's USER_SHAPE: validation each epoch, an epoch-stepped StepLR,
#: ModelCheckpoint(monitor="val_loss", save_last=True)), two epochs of 400 / (4 x ranks) steps.
EPOCH_END = {"EPOCHS": "2", "USER_SHAPE": "1"}
_epoch_end_reference: dict[tuple, Path] = {}


def fit_loop_progress(path: Path) -> dict:
    fit = torch.load(path, map_location="cpu", weights_only=False)["loops"]["fit_loop"]
    return {key: fit[key] for key in ("epoch_progress", "epoch_loop.batch_progress", "epoch_loop.state_dict")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loader, nproc", [
    pytest.param("plain", 2, id="plain-loader-2-ranks"),
    pytest.param("restartable", 2, id="restartable-loader-2-ranks", marks=pytest.mark.long),
    pytest.param("plain", 4, id="plain-loader-4-ranks", marks=pytest.mark.long),
])
def test_lightning_recovers_in_place_from_an_epochs_last_batch_exactly(loader, nproc, tmp_path, tmp_path_factory):
    """Rank 1 fails as the second epoch's first batch starts: the live state is the first epoch's last
    batch, which Lightning counts one short. The next attempt trains the second epoch whole, in the
    sampler's order of that epoch (a plain DataLoader too: it resumes from an epoch's end), and ends
    with the uninterrupted run's weights and loop counters (before the fix: epoch 0's order; the
    epoch counters one behind in every later checkpoint)."""
    env = {**EPOCH_END, "LOADER": loader}
    key = (loader, nproc)
    if key not in _epoch_end_reference:
        _epoch_end_reference[key] = torchrun("lightning", tmp_path_factory.mktemp(f"ref-epoch-end-{loader}-{nproc}"),
                                             env, nproc=nproc)[0]
    ref = _epoch_end_reference[key]
    last = 400 // (4 * nproc)  # the first epoch's last step
    run, _, output = torchrun("lightning", tmp_path, {**env, "INPLACE": "2",
                                                      "FTH_INJECT": f"raise@rank=1,iteration={last + 1}"}, nproc=nproc)
    assert all(tries(run, rank)[1]["start_iteration"] == last for rank in range(nproc))
    assert recomputed(run) == 0
    assert_recovered_exactly(run, ref, "lightning", same_process=(True,) * nproc, live=True)
    assert fit_loop_progress(run / "ckpt" / "last.ckpt") == fit_loop_progress(ref / "ckpt" / "last.ckpt")


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["lightning", "ignite"])
def test_with_persistent_workers_the_failed_attempts_workers_are_not_waited_for(framework, tmp_path, tmp_path_factory):
    """``PERSISTENT=1``: the failed attempt's persistent iterator is collected with its loader by the
    teardown's ``gc.collect()``, which finalized its index queues first: torch's "exit" to the workers
    never left, and its shutdown waited 5 s for each, then SIGTERMed them (Lightning: ``collected
    10.07`` s in the log line). Now its workers are killed at once: none of attempt 0 got a SIGTERM,
    and the recovery is exact."""
    ref = reference(framework, tmp_path_factory)
    run, _, output = torchrun(framework, tmp_path, {"INPLACE": "2", "PERSISTENT": "1",
                                                    "FTH_INJECT": "raise@rank=1,iteration=37"})
    assert_recovered_exactly(run, ref, framework, live=True)
    noted = run / "worker_sigterm.jsonl"
    sigterms = [json.loads(line) for line in noted.read_text().splitlines()] if noted.exists() else []
    assert [s for s in sigterms if s["attempt"] == 0] == [], sigterms
    print(*re.findall(r"\[rank \d\] recovering in place.*?re-formed [\d.]+ s", output), sep="\n")


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework, every", LIVE_CASES)
def test_a_hung_rank_is_interrupted_and_recovers_in_place_from_live_state(framework, every, tmp_path, tmp_path_factory):
    ref = reference(framework, tmp_path_factory)
    run, _, output = torchrun(framework, tmp_path, {"INPLACE": "2", "EVERY": every, "FTH_INJECT": "hang@rank=1,iteration=37",
                                                    "FTH_HANG_TIMEOUT_SEC": "3"})
    assert recomputed(run) == 0  # before live state: 6 (from the checkpoint of 30), 36 without a checkpoint
    assert_recovered_exactly(run, ref, framework, live=True)
    assert "[rank 1] the hung main thread was interrupted: recovering in place" in output
    assert "HangInterrupted" in output


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["ignite", "lightning"])
def test_without_live_state_the_newest_checkpoint_serves(framework, tmp_path, tmp_path_factory):
    """``FTH_LIVE_STATE=0``: as before live state, from the checkpoint of iteration 30, and the log
    line says why."""
    ref = reference(framework, tmp_path_factory)
    run, _, output = torchrun(framework, tmp_path, {"INPLACE": "2", "FTH_LIVE_STATE": "0",
                                                    "FTH_INJECT": "raise@rank=1,iteration=37"})
    assert_recovered_exactly(run, ref, framework)
    assert recomputed(run) == 6
    assert output.count("the next call starts from what it loads itself: the newest checkpoint, or the start if it "
                        "loads none (live state cannot serve: no rank holds "
                        "live state (rank 0: FTH_LIVE_STATE=0))") == 2, output[-3000:]


@pytest.mark.timeout(300)
def test_a_hang_inside_a_step_that_swallows_every_exception_recovers_in_place(tmp_path):
    """Every rank's training step wraps its body in ``try/except Exception: pass``, and rank 1 hangs
    inside it (``SWALLOW=1``: the step fires ``FTH_INJECT``). The interrupt, a ``BaseException``, goes
    through the user's ``except Exception``: both ranks recover in place, in their own processes.
    (Not checked exactly: rank 0's step swallows its released collectives too and trains on alone
    until its watchdog has the failure, a few steps here, where steps take a millisecond.)"""
    run, _, output = torchrun("ignite", tmp_path, {"INPLACE": "2", "SWALLOW": "1", "FTH_HANG_TIMEOUT_SEC": "3",
                                                   "FTH_INJECT": "hang@rank=1,iteration=37"})
    for rank in (0, 1):
        seen = tries(run, rank)
        assert set(seen) == {0, 1}, f"rank {rank}: attempts {sorted(seen)}"
        assert len({t["pid"] for t in seen.values()}) == 1, f"rank {rank}: not recovered in its own process"
        assert seen[1]["done"] and not seen[0].get("done"), seen
        # the cause is the hang rank 1's watchdog declared (its record), not the interrupt that ended its step
        assert re.search(rf"\[rank {rank}\] recovering in place, attempt 1 \(max_restarts=2\), after rank 1 failed: "
                         r"RankHung: rank 1 \(pid \d+ on [^)]*\) hung: its main thread made no progress for [\d.]+ s "
                         r"at step 37", output), output[-4000:]
    assert "[rank 1] the hung main thread was interrupted: recovering in place" in output


def assert_only_the_hung_rank_is_named(output: str, hung: int, nproc: int, step: int = 37) -> None:
    """Every rank's report names ``hung``, and no other rank declares itself or is named hung; the
    report names the step the rank hung in, the one ``FTH_INJECT`` named (not the last completed)."""
    named = set(re.findall(r"RankHung: rank (\d+)", output))
    assert named == {str(hung)}, f"ranks named hung: {sorted(named)}\n{output[-4000:]}"
    assert re.search(rf"rank {hung}\b[^\n]* hung: its main thread made no progress for [\d.]+ s at step {step}\b",
                     output), output[-4000:]
    for rank in set(range(nproc)) - {hung}:
        assert f"[rank {rank}] the hung main thread was interrupted" not in output, output[-4000:]


#: (framework, ranks, the hung rank); at 4 ranks with 25 iterations an epoch, two epochs: iteration 37 is in the second
HUNG_CASES = [
    pytest.param("lightning", 2, 1, id="lightning-2-ranks"),
    pytest.param("ignite", 2, 1, id="ignite-2-ranks", marks=pytest.mark.long),
    pytest.param("ignite", 4, 2, id="ignite-4-ranks-rank-2"),
    pytest.param("ignite", 4, 0, id="ignite-4-ranks-rank-0", marks=pytest.mark.long),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework, nproc, hung", HUNG_CASES)
def test_a_peer_waiting_to_recover_with_a_hung_rank_is_not_named_hung_too(framework, nproc, hung, tmp_path):
    """No checkpoint in the run, ``hang_timeout`` 5 s, rank ``hung`` asleep at iteration 37: it is
    named hung and interrupted; its peers, blocked in the DDP all_reduce behind it until its failure
    released them, then handling the failure (they took its record and wait in the recovery), made
    no progress for as long, but are not hung: none may declare itself (at 2 ranks rank 0 did, 2
    runs of 3, and the job ended instead of recovering; at 4 ranks a released peer's watchdog named
    it hung 0.1 s after it took rank 2's failure, in 1 run of 1). Every rank recovers from its live
    state (iteration 36)."""
    run, _, output = torchrun(framework, tmp_path, {"INPLACE": "2", "EVERY": "1000", "FTH_HANG_TIMEOUT_SEC": "5",
                                                   "FTH_INJECT": f"hang@rank={hung},iteration=37",
                                                   **({} if nproc == 2 else {"EPOCHS": "2", "STEP_MS": "50"})},
                              nproc=nproc)
    assert_only_the_hung_rank_is_named(output, hung, nproc)
    assert f"[rank {hung}] the hung main thread was interrupted: recovering in place" in output
    for rank in range(nproc):
        assert f"[rank {rank}] recovering in place, attempt 1 (max_restarts=2), after rank {hung} failed" in output
        seen = tries(run, rank)
        assert set(seen) == {0, 1}, f"rank {rank}: attempts {sorted(seen)}"
        assert seen[1]["done"] and seen[1]["start_iteration"] == 36, seen[1]
        assert Path(seen[1]["resumed_from"]).name == "live-state-step=36.pt", seen[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hung", [2, pytest.param(0, marks=pytest.mark.long)])
def test_without_recovery_the_peers_of_a_hung_rank_fail_together_naming_it_only(hung, tmp_path):
    """The same hang at 4 ranks with no recovery (``torchrun --max-restarts 0``, no
    ``recover_in_place``): the hung rank ends with its report, and every other rank's names it;
    none declares itself."""
    from fault_tolerant_handlers import EXIT_HUNG

    run, code, output = torchrun("ignite", tmp_path, {"EVERY": "1000", "FTH_HANG_TIMEOUT_SEC": "5", "EPOCHS": "2",
                                                      "FTH_INJECT": f"hang@rank={hung},iteration=37", "STEP_MS": "50"},
                                 nproc=4, expect_ok=False)
    assert code != 0
    assert_only_the_hung_rank_is_named(output, hung, 4)
    assert f"exit code {EXIT_HUNG}" in output, output[-4000:]
    for rank in set(range(4)) - {hung}:
        assert re.search(rf"\[rank {rank}[^\]]*\] stopping: RankHung: rank {hung} ", output), output[-4000:]


@pytest.mark.long
@pytest.mark.timeout(300)
def test_two_failures_recover_twice_and_the_log_names_each(tmp_path, tmp_path_factory):
    ref = reference("ignite", tmp_path_factory)
    run, _, output = torchrun("ignite", tmp_path, {
        "INPLACE": "2", "FTH_INJECT": "raise@rank=1,iteration=37; raise@rank=0,iteration=44,attempt=1"})
    assert_recovered_exactly(run, ref, "ignite", attempts=2, live=True)
    assert tries(run, 0)[2]["start_iteration"] == 43 and recomputed(run, 2, failing=0) == 0
    assert "recovering in place, attempt 2 (max_restarts=2), after rank 0 failed in train" in output


@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_failure_that_repeats_at_the_same_iteration_ends_the_job(tmp_path):
    run, code, output = torchrun("ignite", tmp_path, {"INPLACE": "3", "FTH_INJECT": "raise@rank=1,iteration=37,attempt=any"},
                                 expect_ok=False)
    assert code != 0
    for rank in (0, 1):
        assert set(tries(run, rank)) == {0, 1}, "one recovery, then the repeat ended the job"
    for rank in (0, 1):  # every rank logs it (and notes it on the exception it raises)
        assert (f"[rank {rank}] fault-tolerant-handlers: not recovered in place: the failure repeats at the same "
                "iteration (rank 1 failed in train: InjectedFault") in output, output[-3000:]
    assert "attempt 0: rank 1 failed in train: InjectedFault" in output


@pytest.mark.timeout(300)
def test_max_restarts_spent_ends_the_job_naming_every_attempt(tmp_path):
    run, code, output = torchrun("ignite", tmp_path, {
        "INPLACE": "1", "FTH_INJECT": "raise@rank=1,iteration=37; raise@rank=0,iteration=44,attempt=1"}, expect_ok=False)
    assert code != 0
    for rank in (0, 1):
        assert set(tries(run, rank)) == {0, 1}
    for rank in (0, 1):
        assert f"[rank {rank}] fault-tolerant-handlers: not recovered in place: max_restarts=1 recoveries in place " \
               "already spent" in output
    assert "attempt 0: rank 1 failed in train: InjectedFault" in output
    # torchrun's Root Cause is the failure the job ended on (rank 0's, attempt 1), not the one recovered
    rank, block = torchrun_root_cause(output)
    assert rank == 0, block
    assert "InjectedFault: injected by FTH_INJECT: raise@rank=0,iteration=44,attempt=1" in block
    assert "iteration=37" not in block


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework, every", [
    pytest.param("ignite", "10", id="ignite-every-10"),
    pytest.param("ignite", "1000", id="ignite-no-checkpoint", marks=pytest.mark.long),
    pytest.param("lightning", "10", id="lightning-every-10", marks=pytest.mark.long),
])
def test_a_killed_rank_is_replaced_in_place_and_the_others_keep_their_processes(framework, every, tmp_path,
                                                                                 tmp_path_factory):
    """The killed rank's new process holds no state: the survivor sends it its live state over a group
    the recovery forms, and both carry on from the last completed iteration (none trained twice), with
    a checkpoint every 10 iterations or none at all; its RNG states too, Python's ``random`` and numpy's
    global RNG with torch's (``PY_RANDOM``: the steps draw from both, seeded as the function starts)."""
    ref = reference(framework, tmp_path_factory, PY_RANDOM)
    run, _, output = torchrun(framework, tmp_path, {**PY_RANDOM, "INPLACE": "2", "EVERY": every,
                                                    "FTH_INJECT": "kill@rank=1,iteration=37"})
    assert_recovered_exactly(run, ref, framework, same_process=(True, False), live=True)
    assert recomputed(run) == 0  # before the transfer: 6 (from the checkpoint of 30), 36 without a checkpoint
    assert "PeerLost: rank 1 (pid" in output and "killed by SIGKILL" in output
    assert "[rank 1] the training process of rank 1 (pid" in output and "killed by SIGKILL: starting its replacement" in output
    assert "after rank 1 failed: RankReplaced" in output
    step = tries(run, 0)[1]["start_iteration"]
    assert output.count(f"live state, {UNIT[framework]} {step} (each rank's own; sent "
                        "from rank 0 to rank 1: its process was replaced (its state ended with it); its RNG states "
                        "too), is held for the next call") == 2, output[-3000:]
    assert output.count(f"carries on from live state, {UNIT[framework]} {step} (") == 2, output[-3000:]
    assert output.count("live state sent ") == 2, output[-3000:]  # a part of the recovery's timings
    if framework == "ignite":  # the survivor's first group, destroyed by the recovery, is freed (its threads, sockets)
        assert tries(run, 0)[1]["earlier_groups_alive"] == 0
        # the replacement was forked with what DDP imports lazily (its keeper imported it before the first
        # fork): its DDP, and so every rank's, does not wait 0.3-0.5 s for the import (Lightning imports it itself)
        assert tries(run, 1)[1]["dynamo_at_start"] is True
    # when the survivor's release cut its connections to the killed rank (its main thread may take the
    # failure first, and nothing is cut), the teardown quieted them in the destroyed group's loops (a loop
    # left on them can spin at up to a core: tests/distributed/test_release_quiet.py)
    quieted = re.findall(r"\[rank 0\] recovering in place, .* (\d+) socket registrations of the released groups quieted",
                         output)
    cut = re.findall(r"\[rank 0[^\]]*\] released blocked collectives: closed (\d+) gloo connections", output)
    assert len(quieted) == 1 and (int(quieted[0]) > 0) == (sum(map(int, cut)) > 0), output[-3000:]


@pytest.mark.timeout(300)
def test_a_survivor_stuck_where_no_release_reaches_is_replaced_in_place(tmp_path, tmp_path_factory):
    """Rank 1 raises at iteration 37 while rank 0 waits for it in the step's all-reduce, and nothing
    releases rank 0 (``FTH_RELEASE=exit`` stands for a collective a release cannot break): rank 0 ends
    with exit code 87 after ``FTH_EXIT_GRACE_SEC``. Its keeper replaces it as it would a killed rank;
    the new process receives rank 1's live state, and the job ends with the uninterrupted weights."""
    ref = reference("ignite", tmp_path_factory)
    run, _, output = torchrun("ignite", tmp_path, {"INPLACE": "2", "FTH_RELEASE": "exit", "FTH_EXIT_GRACE_SEC": "1",
                                                   "FTH_INJECT": "raise@rank=1,iteration=37"})
    assert "[rank 0] ending this process with exit code 87" in output
    assert "[rank 0] the training process of rank 0 (pid" in output and \
        "exited with code 87: starting its replacement, which joins the recovery of attempt 0" in output, output[-4000:]
    assert_recovered_exactly(run, ref, "ignite", same_process=(False, True), live=True)
    assert recomputed(run) == 0


@pytest.mark.timeout(300)
def test_a_failure_between_a_survivors_optimizer_step_and_the_iterations_end_leaves_it_live_state(
        tmp_path, tmp_path_factory):
    """Rank 1 is SIGKILLed as iteration 37 starts; rank 0, past the optimizer step of iteration 36, waits
    there until its watchdog knows (``STALL_AFTER_STEP``): the failure reaches it between the step's
    update and the iteration's end, where the end-of-iteration check raises it. Rank 0 still holds the
    live state of iteration 36 (the mark comes before the check): its replaced peer receives it and both
    carry on from there, nothing trained twice (before: 'no rank holds live state', back to iteration 30)."""
    ref = reference("ignite", tmp_path_factory)
    run, _, output = torchrun("ignite", tmp_path, {"INPLACE": "2", "STALL_AFTER_STEP": "0:36",
                                                   "FTH_INJECT": "kill@rank=1,iteration=37"})
    assert json.loads((run / "stalled_rank0.json").read_text())["peer_failed"], "the failure did not come in the stall"
    assert_recovered_exactly(run, ref, "ignite", same_process=(True, False), live=True)
    assert recomputed(run) == 0
    assert output.count("live state, iteration 36 (each rank's own") == 2 and output.count("carries on from live state, iteration 36") == 2, output[-3000:]
    # the RNG states recorded at the iteration's mark go with it (iteration 37 had not started)
    assert output.count("its process was replaced (its state ended with it); its RNG states too), is held") == 2, output[-3000:]


@pytest.mark.timeout(300)
def test_live_state_that_arrives_corrupted_is_refused_and_every_rank_resumes_from_its_checkpoint(
        tmp_path, tmp_path_factory):
    """Rank 1 is SIGKILLed at iteration 37; rank 0's live state reaches its new process with one
    byte flipped on the way (``CORRUPT_LIVE_STATE``). The receiver's check refuses it, every rank
    learns so, and both carry on from the newest checkpoint (iteration 30: 6 trained twice), not from
    a state that is not the survivor's; the log says why, and the weights are the uninterrupted run's."""
    ref = reference("ignite", tmp_path_factory)
    run, _, output = torchrun("ignite", tmp_path, {"INPLACE": "2", "EVERY": "10", "CORRUPT_LIVE_STATE": "1",
                                                   "FTH_INJECT": "kill@rank=1,iteration=37"})
    assert_recovered_exactly(run, ref, "ignite", same_process=(True, False), live=False)
    assert recomputed(run) == 6
    assert output.count("the next call starts from what it loads itself: the newest checkpoint, or the start if it "
                        "loads none (live state cannot serve: sending it from rank 0 failed: StateTransferError") == 2, \
        output[-3000:]
    assert output.count("this attempt starts at iteration 30: from the checkpoint the script loaded (live state could "
                        "not serve: sending it from rank 0 failed") == 2, output[-3000:]


@pytest.mark.long
@pytest.mark.timeout(300)
def test_without_replace_dead_a_killed_rank_ends_the_attempt_and_the_relaunch_resumes(tmp_path, tmp_path_factory):
    ref = reference("ignite", tmp_path_factory)
    run, _, output = torchrun("ignite", tmp_path, {"INPLACE": "2", "INPLACE_REPLACE": "0",
                                                   "FTH_INJECT": "kill@rank=1,iteration=37"}, max_restarts=1)
    pids = [{a: t["pid"] for a, t in tries(run, rank).items()} for rank in (0, 1)]
    assert all(set(p) == {0, 1} and p[0] != p[1] for p in pids), f"expected a relaunch (new processes): {pids}"
    assert "PeerLost: rank 1 (pid" in output and "killed by SIGKILL" in output
    assert "a dead rank's process cannot be replaced in place here (replace_dead=False)" not in output
    for rank in (0, 1):
        got, want = trained(run, rank), trained(ref, rank)
        assert [(e["step"], e["idx"]) for e in got if e["attempt"] == 1] == [(e["step"], e["idx"]) for e in want[30:]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recoveries", [6, pytest.param(20, marks=pytest.mark.long)])
def test_twenty_recoveries_leave_nothing_behind(recoveries, tmp_path):
    """20 recoveries in one job (``inplace_lifecycle_main.py``; 6 in the default suite): each attempt
    starts with the same fds, threads, child processes and keys in torchrun's store as the one before,
    and memory stays flat."""
    script = PROGRAMS / "inplace_lifecycle_main.py"
    out = tmp_path / f"{script.stem}-1"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]
    try:
        results = run_ranks(1, "", tmp_path, script=script, launcher=launcher, deadline=240,
                            env={"FTH_INJECT": "", "RECOVERIES": str(recoveries)})
    finally:
        kill_workers(out, program=script.name)
    output = results[0].stderr
    assert results[0].returncode == 0, output[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: trained to the end in attempt {recoveries}" in output
        rows = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()][:-1]
        print(f"rank {rank}:", *(f"attempt {r['attempt']}: fds {r['fds']} threads {r['threads']} children "
                                 f"{r['children']} store keys {r['keys']} rss {r['rss_kb'] // 1024} MB" for r in rows), sep="\n  ")
        assert [r["attempt"] for r in rows] == list(range(recoveries + 1))
        settled = rows[2]  # the first attempts import lazily (Ignite, the signal thread)
        for row in rows[2:]:
            for what in ("fds", "threads", "children"):
                assert row[what] == settled[what], f"rank {rank} attempt {row['attempt']}: {what} {row[what]} != {settled[what]}"
        # The store is shared: the peer may be a key or two ahead or behind at the moment of the count
        # (its recovery's keys, its session's), but the count does not grow with the recoveries (an
        # attempt's leaked keys were 4 to 8 more per recovery).
        keys = [r["keys"] for r in rows]
        assert max(keys[2:]) - min(keys[2:]) <= 2, f"rank {rank}: the store's keys grow: {keys}"
        assert rows[-1]["rss_kb"] - settled["rss_kb"] < 32 * 1024, "memory grows with the recoveries"


@pytest.mark.timeout(300)
def test_a_function_that_cannot_be_called_twice_ends_with_a_clear_error(tmp_path):
    script = PROGRAMS / "inplace_unsafe_main.py"
    out = tmp_path / f"{script.stem}-1"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]
    try:
        results = run_ranks(1, "", tmp_path, script=script, launcher=launcher, deadline=120, env={"FTH_INJECT": ""})
    finally:
        kill_workers(out, program=script.name)
    output = results[0].stderr
    assert results[0].returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] recovering in place, attempt 1 (max_restarts=2)" in output
    assert output.count("RecoveryError: recover_in_place: attempt 1 of the training function failed before it "
                        "trained (no fail-together session had started): RuntimeError:") == 2, output[-3000:]
    assert "The function must build everything it uses each time it is called" in output


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["ignite", "lightning"])
def test_a_killed_dataloader_worker_needs_no_recovery(framework, tmp_path, tmp_path_factory):
    """The loader replaces its worker in place: attempt 0 trains to the end, exactly."""
    ref = reference(framework, tmp_path_factory)
    run, _, _ = torchrun(framework, tmp_path, {"INPLACE": "2", "FTH_INJECT": "worker-kill@rank=1,iteration=37"})
    for rank in (0, 1):
        seen = tries(run, rank)
        assert set(seen) == {0} and seen[0]["done"] and seen[0]["worker_restarts"] == (1 if rank == 1 else 0), seen
        assert [(e["step"], e["idx"]) for e in trained(run, rank)] == [(e["step"], e["idx"]) for e in trained(ref, rank)]
    final, expected = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    assert all(torch.equal(final[k], expected[k]) for k in expected)


@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_rank_hung_where_no_signal_reaches_it_is_replaced_in_place(tmp_path, tmp_path_factory):
    """Its main thread cannot be interrupted (``HANG_IN_C``: the signal blocked, as in a C call): it
    ends as a hung rank (exit code 88) and its keeper replaces it."""
    ref = reference("ignite", tmp_path_factory)
    run, _, output = torchrun("ignite", tmp_path, {"INPLACE": "2", "HANG_IN_C": "37", "FTH_HANG_TIMEOUT_SEC": "3"})
    assert_recovered_exactly(run, ref, "ignite", same_process=(True, False), live=True)
    assert "exited with code 88: starting its replacement" in output


@pytest.mark.long
@pytest.mark.timeout(300)
def test_rank_0_killed_is_replaced_in_place(tmp_path, tmp_path_factory):
    """Rank 0 decides each recovery: its replacement does, with the survivors waiting for it."""
    ref = reference("ignite", tmp_path_factory)
    run, _, output = torchrun("ignite", tmp_path, {"INPLACE": "2", "FTH_INJECT": "kill@rank=0,iteration=37"})
    assert_recovered_exactly(run, ref, "ignite", same_process=(False, True), live=True)
    assert "[rank 0] the training process of rank 0 (pid" in output
