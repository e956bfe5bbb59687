"""Sharded models (FSDP2 ``fully_shard``, Lightning ``ModelParallelStrategy``) and distributed
checkpoints (``torch.distributed.checkpoint``, DCP), as the examples run them, on 2 CPU ranks (gloo).

* ``examples/ignite_fsdp.py``: Ignite + FSDP2 with ``DCPSaver``; rank 1 raises at iteration 17; a
  recovery in place carries on from live state (each rank its own shard, copied at the failure into a
  checksummed CPU snapshot) at iteration 16, no step computed twice, and a torchrun relaunch resumes
  from ``checkpoint_10``; both end with the SHA-256 of the final weights (``full_tensor()``) of an
  uninterrupted run. Before this: live state was refused for a sharded model and the in-place run
  resumed from ``checkpoint_10`` (6 steps computed twice); before that, it died of SIGSEGV (the
  live-state checksum read a ``DTensor``'s ``data_ptr()``, 0). A rank's snapshot whose bytes
  changed while held is never loaded: every rank resumes from ``checkpoint_10``, the log naming why.
* ``examples/lightning_model_parallel.py``: ``ModelParallelStrategy`` with
  ``save_distributed_checkpoint`` False (a file) and True (a directory); in place, rank 1 raises at
  step 17 and, in the next attempt, the last rank hangs at step 23: every rank carries on from its own
  shard (16, then 22), no step computed twice, with an uninterrupted run's final weights. Before
  this: live state was refused and every rank resumed from the checkpoints of steps 10 and 20;
  before that, the file's in-memory copy was handed to a strategy that ignores it (freshly
  initialised weights, exit 0), and the directory was not found (trained from step 0 again).
* A save killed midway (DCP's shards written, its ``.metadata`` not; Lightning's ``meta.pt`` not;
  ``DCPSaver``'s temporary directory, or the directory it replaces half removed) is never what
  ``latest_checkpoint`` chooses; in a training job (a rank SIGKILLed inside DCP's save, 2 and 4
  ranks), every rank resumes from the previous checkpoint, intact.
* A rank SIGKILLed or hung: in place (the keeper's replacement; ``hang_timeout``) and relaunched,
  Ignite + FSDP2 and Lightning ``ModelParallelStrategy`` in both forms, 2 and 4 ranks, every rank
  resumes from the newest complete checkpoint with an uninterrupted run's final weights; in place
  after a hang, from its own shard.

* ``FTH_SHARD_REPLICAS=1``: a rank SIGKILLed in place gets its shard of the iteration before from
  its partner's copy, with its RNG states (``programs/dropout_fsdp_main.py``: dropout and noise in the
  step), and every rank carries on there (0 steps computed twice) with an uninterrupted run's weights;
  the same for Lightning ``ModelParallelStrategy`` (rank 1 killed mid-epoch, both checkpoint forms).

Every run is bounded and every process it started is killed by pid (see ``test_examples._run``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from launch import DECLARATIONS, ROOT, cpu_hogs
import test_examples
from test_examples import _commands

from fault_tolerant_handlers import latest_checkpoint

IGNITE = ROOT / "examples" / "ignite_fsdp.py"
LIGHTNING = ROOT / "examples" / "lightning_model_parallel.py"
SAVE_MAIN = ROOT / "tests" / "programs" / "dcp_save_main.py"
#: A bound per torchrun job (a relaunched job runs twice; unloaded, a run takes 10-30 s here).
DEADLINE_SEC = 300
DIGEST = re.compile(r"\[rank (\d+)\] finished at (?:iteration|step) \d+, weights sha256 ([0-9a-f]{64})")


def _run(line: str, example: Path, tmp_path: Path) -> tuple[int | None, str]:
    """``test_examples._run`` (the printed command in ``tmp_path``, every process killed by pid
    afterwards) bounded by :data:`DEADLINE_SEC`."""
    return test_examples._run(line, example, tmp_path, deadline=DEADLINE_SEC)


def _line(example: Path, in_place: bool, *, world: int = 2) -> str:
    [line] = [c for c in _commands(example) if ("--in-place" in c) == in_place]
    return line.replace("--nproc-per-node 2", f"--nproc-per-node {world}")


def _digests(out: str, world: int) -> set[str]:
    found = dict(DIGEST.findall(out))
    assert sorted(found, key=int) == [str(r) for r in range(world)], out[-4000:]
    return set(found.values())


def _reference(example: Path, tmp_path: Path, world: int = 2, extra: str = "") -> str:
    """The final weights of an uninterrupted run (no FTH_INJECT)."""
    line = _line(example, in_place=False, world=world).split(" ", 1)[1].replace("--max-restarts 1 ", "") + extra
    returncode, out = _run(line, example, tmp_path)
    assert returncode == 0, out[-4000:]
    digests = _digests(out, world)
    assert len(digests) == 1, out[-4000:]
    return digests.pop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(example, world)``: the final weights of an uninterrupted run, one run per pair."""
    found: dict[tuple[Path, int], str] = {}

    def get(example: Path, world: int = 2) -> str:
        pytest.importorskip("ignite" if example == IGNITE else "lightning")
        if (example, world) not in found:
            found[example, world] = _reference(example, tmp_path_factory.mktemp(f"{example.stem}-{world}"), world)
        return found[example, world]

    return get


@pytest.fixture(scope="module")
def ignite_reference(reference) -> str:
    return reference(IGNITE)


@pytest.fixture(scope="module")
def lightning_reference(reference) -> str:
    return reference(LIGHTNING)


def test_sharded_examples_print_both_rehearsals():
    for example in (IGNITE, LIGHTNING):
        lines = _commands(example)
        assert {"--in-place" in line for line in lines} == {True, False}, lines
        assert all("FTH_INJECT=raise@rank=1,iteration=17 torchrun --standalone --nproc-per-node 2" in line
                   for line in lines), lines


def _check_recovered(out: str, returncode: int | None, resumed: str, reference: str, in_place: bool,
                     world: int = 2) -> None:
    assert returncode is not None, f"still running after {DEADLINE_SEC} s (killed):\n{out[-4000:]}"
    assert "SIGSEGV" not in out and "Segmentation fault" not in out, out[-4000:]
    assert "FTH_INJECT=raise@rank=1,iteration=17: injecting raise" in out, out[-4000:]  # the fault fired
    assert re.search(r"\[rank 0 step \d+\] stopping: rank 1 failed in 'train'", out), out[-4000:]  # together
    for rank in range(world):
        assert f"[rank {rank}] attempt 1: {resumed}" in out, out[-4000:]
    if in_place:
        assert "recovering in place, attempt 1" in out, out[-4000:]
        assert "live state refused" not in out, out[-4000:]  # served for every sharded form here
    assert returncode == 0, out[-4000:]
    assert _digests(out, world) == {reference}, f"final weights differ from an uninterrupted run's:\n{out[-4000:]}"


def _check_own_shards(out: str, world: int, step: int, unit: str = "iteration") -> None:
    """Every rank carried on from its own shard of ``step``: nothing computed twice, nothing sent."""
    assert "live state refused" not in out, out[-4000:]
    for rank in range(world):
        assert re.search(rf"\[rank {rank}[^\]]*\] .*live state, {unit} {step} \(each rank's own\), is held", out), \
            (rank, out[-4000:])
        assert re.search(rf"\[rank {rank}[^\]]*\] carries on from live state, {unit} {step} \(loaded by the script "
                         rf"from live-state-step={step}\.pt\): no step computed twice", out), (rank, out[-4000:])


@pytest.mark.timeout(2 * DEADLINE_SEC + 60)
def test_ignite_fsdp_in_place_carries_on_from_each_ranks_own_shard_exactly(ignite_reference, tmp_path):
    """Rank 1 raises at iteration 17: every process survives, each rank holds its shard of iteration
    16 (copied at the failure, checksummed), and every rank carries on from it: 0 steps computed
    twice (before: from ``checkpoint_10``, 6), and the uninterrupted run's final weights."""
    returncode, out = _run(_line(IGNITE, True), IGNITE, tmp_path)
    _check_recovered(out, returncode, "resumed from live-state-step=16.pt at iteration 16", ignite_reference, True)
    _check_own_shards(out, 2, 16)


@pytest.mark.timeout(2 * DEADLINE_SEC + 60)
def test_ignite_fsdp_relaunch_resumes_exactly_from_a_distributed_checkpoint(ignite_reference, tmp_path):
    returncode, out = _run(_line(IGNITE, False), IGNITE, tmp_path)
    _check_recovered(out, returncode, "resumed from checkpoint_10 at iteration 10", ignite_reference, False)


FLIP_MAIN = ROOT / "tests" / "programs" / "flip_shard_main.py"


@pytest.mark.timeout(2 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("example", [IGNITE, pytest.param(LIGHTNING, marks=pytest.mark.long)],
                         ids=["ignite", "lightning"])
def test_a_shard_whose_bytes_changed_while_held_is_never_loaded(example, reference, tmp_path):
    """Rank 1's shard snapshot has a byte flipped after it was checksummed (``flip_shard_main.py``):
    rank 1 reports it by name (``SnapshotChecksumError``), rank 0's plan names rank 1 and why, and
    every rank resumes from the checkpoint of step 10 (nobody else holds rank 1's shard), exactly."""
    unit, resumed = (("iteration", "resumed from checkpoint_10 at iteration 10") if example == IGNITE
                     else ("global step", "resuming from epoch=0-step=10.ckpt"))
    line = _line(example, True).replace("torchrun ", "FLIP_SHARD=1 torchrun ").replace(
        f"examples/{example.name}", f"examples/{FLIP_MAIN.name} {example}")
    returncode, out = _run(line, FLIP_MAIN, tmp_path)
    assert "[rank 1] flipped a byte of its shard of step 16" in out, out[-4000:]  # the fault fired
    assert re.search(rf"\[rank 1[^\]]*\] live state: SnapshotChecksumError: its shard of {unit} 16 does not have "
                     r"its checksum \(CRC-32 [0-9a-f]{8} when copied, [0-9a-f]{8} now\): never loaded", out), out[-4000:]
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}[^\]]*\] .*live state cannot serve: rank 1 holds no shard of its own "
                         rf"\(SnapshotChecksumError: its shard of {unit} 16", out), (rank, out[-4000:])
    _check_recovered(out, returncode, resumed, reference(example), True)


#: The hang of the Lightning in-place runs: in the attempt after the raise, at global step 23.
THEN_HANG = "hang@rank={rank},iteration=23,attempt=1"


@pytest.mark.timeout(2 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("distributed, world", [
    pytest.param(False, 2, id="file-2"), pytest.param(True, 2, id="directory-2"),
    pytest.param(False, 4, id="file-4", marks=pytest.mark.long),
    pytest.param(True, 4, id="directory-4", marks=pytest.mark.long)])
def test_lightning_model_parallel_in_place_carries_on_from_each_ranks_own_shard_after_a_raise_and_a_hang(
        distributed, world, reference, tmp_path):
    """A user's Lightning script (``configure_model`` calling ``fully_shard``, ``ModelParallelStrategy``,
    ``ModelCheckpoint`` every 10 steps, ``fit(ckpt_path=latest_checkpoint(...))``) under
    ``recover_in_place``: rank 1 raises at global step 17; in the attempt after, the last rank hangs at
    step 23 (``hang_timeout`` of :data:`HANG_SEC`, interrupted where it hangs). After each, every rank
    carries on from its own shard (16, then 22; copied at the failure into a checksummed CPU
    snapshot, loaded into the strategy's model and optimizer by ``fit``): 0 steps computed twice, and
    the uninterrupted run's final weights, in either checkpoint form. Before this: live state was
    refused ("the strategy ModelParallelStrategy builds its checkpoint with collectives") and every
    rank resumed from the checkpoint of step 10, then of step 20 (8 steps computed twice)."""
    expected = reference(LIGHTNING, world)
    hang = THEN_HANG.format(rank=world - 1)
    line = _line(LIGHTNING, in_place=True, world=world).replace(
        "FTH_INJECT=raise@rank=1,iteration=17", f"FTH_INJECT='raise@rank=1,iteration=17;{hang}' "
                                                f"FTH_HANG_TIMEOUT_SEC={HANG_SEC}") + (" --distributed" if distributed else "")
    returncode, out = _run(line, LIGHTNING, tmp_path)
    _check_recovered(out, returncode, "resuming from live-state-step=16.pt", expected, True, world=world)
    assert f"FTH_INJECT={hang}: injecting hang" in out, out[-4000:]  # the second fault fired
    assert f"RankHung: rank {world - 1} (pid" in out, out[-4000:]
    for rank in range(world):
        assert f"[rank {rank}] attempt 2: resuming from live-state-step=22.pt" in out, (rank, out[-4000:])
    assert "attempt 3" not in out, out[-4000:]
    _check_own_shards(out, world, 16, "global step")
    _check_own_shards(out, world, 22, "global step")


@pytest.mark.long
@pytest.mark.timeout(2 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("distributed", [False, True], ids=["file", "directory"])
def test_lightning_model_parallel_relaunch_resumes_exactly(distributed, lightning_reference, tmp_path):
    line = _line(LIGHTNING, in_place=False) + (" --distributed" if distributed else "")
    returncode, out = _run(line, LIGHTNING, tmp_path)
    _check_recovered(out, returncode, "resuming from epoch=0-step=10.ckpt", lightning_reference, False)


@pytest.mark.long
@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "relaunch"])
def test_ignite_fsdp_at_4_ranks(in_place, reference, tmp_path):
    """In place, every rank carries on from its own shard of iteration 16; relaunched, from ``checkpoint_10``."""
    expected = reference(IGNITE, 4)
    returncode, out = _run(_line(IGNITE, in_place, world=4), IGNITE, tmp_path)
    resumed = "resumed from live-state-step=16.pt at iteration 16" if in_place else \
        "resumed from checkpoint_10 at iteration 10"
    _check_recovered(out, returncode, resumed, expected, in_place, world=4)
    if in_place:
        _check_own_shards(out, 4, 16)


# -- SIGKILL and hang --------------------------------------------------------------------------------------

#: (example, its extra argument, what every rank prints when it resumes from the checkpoint of step 20)
FORMS = {"ignite": (IGNITE, "", r"resumed from checkpoint_20 at iteration 20"),
         "lightning-file": (LIGHTNING, "", r"resuming from epoch=\d-step=20\.ckpt"),
         "lightning-directory": (LIGHTNING, " --distributed", r"resuming from epoch=\d-step=20\.ckpt")}
#: The hang timeout of the hang cases (``FTH_HANG_TIMEOUT_SEC``): a few seconds, far above a step here.
HANG_SEC = 5
#: In the default suite: Ignite in place, and Lightning's SIGKILL in place (its lost shard named).
DEFAULT_CASES = {("ignite", "kill", True, 2), ("ignite", "hang", True, 2), ("lightning-directory", "kill", True, 2)}
FAULT_CASES = [pytest.param(form, fault, in_place, world, id=f"{form}-{fault}-{'in-place' if in_place else 'relaunch'}-{world}",
                            marks=() if (form, fault, in_place, world) in DEFAULT_CASES else pytest.mark.long)
               for world in (2, 4) for form in FORMS for fault in ("kill", "hang") for in_place in (True, False)]


def _check_resumed(out: str, returncode: int | None, world: int, resumed: str, reference: str) -> None:
    """Every rank resumed (once) as ``resumed`` (a regex) says, nothing crashed, the job ended 0 with
    the uninterrupted run's final weights on every rank."""
    assert returncode is not None, f"still running after {DEADLINE_SEC} s (killed):\n{out[-4000:]}"
    assert "SIGSEGV" not in out and "Segmentation fault" not in out and "SIGABRT" not in out, out[-4000:]
    for rank in range(world):
        assert re.search(rf"\[rank {rank}\] attempt 1: {resumed}", out), (rank, out[-4000:])
    assert "attempt 2" not in out, out[-4000:]  # one recovery
    assert returncode == 0, out[-4000:]
    assert _digests(out, world) == {reference}, f"final weights differ from an uninterrupted run's:\n{out[-4000:]}"


@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("form, fault, in_place, world", FAULT_CASES)
def test_sharded_job_survives_sigkill_and_hang(form, fault, in_place, world, reference, tmp_path):
    """A rank SIGKILLed (rank 0: DCP's coordinator, the rank that writes Lightning's file) or hung
    (the last rank; ``hang_timeout`` of :data:`HANG_SEC`) at iteration 23, three steps after the
    checkpoint of step 20. In place, the killed rank's process is replaced by its keeper and the hung
    one interrupted where it hangs; relaunched, torchrun starts every rank again. Every rank resumes
    from the checkpoint of step 20 (the newest complete one; that of step 10 is still there for
    Ignite), in its form (Ignite's ``DCPSaver`` directory, Lightning's file or directory), and the
    final weights are bit for bit an uninterrupted run's: the data path is exact, so this is proved
    against the uninterrupted run itself, not against a run resumed from the same checkpoint.
    In place (Ignite + FSDP2 and Lightning ``ModelParallelStrategy``): a hung rank's process survives,
    so every rank carries on from its own shard of step 22 (0 steps computed twice); a killed rank's
    shard went with it (no partner holds a copy without `FTH_SHARD_REPLICAS`), which the plan says by name."""
    example, extra, resumed = FORMS[form]
    own_shards = in_place and fault == "hang"
    unit = "iteration" if form == "ignite" else "global step"
    if own_shards:
        resumed = (r"resumed from live-state-step=22\.pt at iteration 22" if form == "ignite"
                   else r"resuming from live-state-step=22\.pt")
    expected = reference(example, world)
    victim = 0 if fault == "kill" else world - 1
    inject = f"{fault}@rank={victim},iteration=23"
    line = _line(example, in_place, world=world).replace(
        "FTH_INJECT=raise@rank=1,iteration=17", f"FTH_INJECT={inject}" + (f" FTH_HANG_TIMEOUT_SEC={HANG_SEC}"
                                                                          if fault == "hang" else "")) + extra
    returncode, out = _run(line, example, tmp_path)
    assert f"FTH_INJECT={inject}: injecting {fault}" in out, out[-4000:]  # the fault fired
    if fault == "kill":
        assert f"rank {victim} (pid" in out and "killed by SIGKILL" in out, out[-4000:]  # named by its peers
        if in_place:
            assert f"[rank {victim}] the training process of rank {victim}" in out, out[-4000:]  # its keeper
        if in_place:
            assert re.search(rf"live state cannot serve: rank {victim} holds no shard of its own \(its process was "
                             r"replaced", out), out[-4000:]
    else:
        assert f"RankHung: rank {victim} (pid" in out, out[-4000:]
    if in_place:
        assert "recovering in place, attempt 1" in out, out[-4000:]
    _check_resumed(out, returncode, world, resumed, expected)
    if own_shards:
        _check_own_shards(out, world, 22, unit)


# -- a save killed midway ------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_latest_checkpoint_never_chooses_a_distributed_save_killed_midway(tmp_path):
    """``dcp_save_main.py`` writes a complete checkpoint of step 10 in three folders, starts one of
    step 20 in each and stops midway; it is SIGKILLed (by pid) there. Before this, the directories
    were not checkpoints at all: ``latest_checkpoint`` answered ``None`` (the job started over)."""
    root = tmp_path / "ckpts"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    with open(tmp_path / "output.txt", "w+") as out:
        proc = subprocess.Popen([sys.executable, str(SAVE_MAIN), str(root)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            end = time.monotonic() + 150
            while time.monotonic() < end and proc.poll() is None and not (root / "stopped").exists():
                time.sleep(0.1)
        finally:
            stopped = (root / "stopped").exists()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=10)
        out.seek(0)
        assert stopped, f"the saves did not reach their stop (rc={proc.returncode}):\n{out.read()[-3000:]}"
    cases = [("dcp", "checkpoint_10", "checkpoint_20"),  # DCP's shards written, its .metadata not
             ("saver", "checkpoint_10", "tmp-checkpoint_20"),  # DCPSaver's temporary directory
             ("lightning", "epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"),  # .metadata, no Lightning meta.pt
             ("replace", "checkpoint_10", "tmp-checkpoint_10.old")]  # the one a re-save replaces, half removed
    for case, complete, torn in cases:
        folder = root / case
        assert (folder / torn).is_dir() and any((folder / torn).iterdir()), case  # the kill left it half-written
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chosen = latest_checkpoint(folder)
        assert chosen == str(folder / complete), case
        last = {"dcp": ".metadata", "lightning": "meta.pt"}.get(case, "rank0.pt")  # DCPSaver's: rank0.pt too
        assert (Path(chosen) / last).is_file(), case
        assert any(torn in str(w.message) for w in caught), (case, [str(w.message) for w in caught])


KILL_IN_SAVE = ROOT / "tests" / "programs" / "dcp_kill_in_save_main.py"
#: (form, the killed rank, where in the save, in place, world size, the torn directory it leaves)
SAVE_KILL_CASES = [
    pytest.param("ignite", 1, "shards", True, 2, "tmp-checkpoint_20", id="ignite-rank1-shards-in-place"),
    pytest.param("ignite", 0, "metadata", False, 2, "tmp-checkpoint_20", id="ignite-rank0-metadata-relaunch"),
    pytest.param("lightning-directory", 0, "shards", False, 2, "epoch=0-step=20.ckpt",
                 id="lightning-rank0-shards-relaunch"),
    pytest.param("lightning-directory", 0, "metadata", True, 2, "epoch=0-step=20.ckpt",
                 id="lightning-rank0-metadata-in-place"),
    pytest.param("lightning-directory", 3, "shards", True, 4, "epoch=1-step=20.ckpt", id="lightning-rank3-shards-in-place-4"),
]


@pytest.mark.long
@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("form, victim, at, in_place, world, torn", SAVE_KILL_CASES)
def test_a_rank_killed_in_a_distributed_save_resumes_from_the_previous_checkpoint(form, victim, at, in_place, world,
                                                                                  torn, reference, tmp_path):
    """A rank SIGKILLs itself in the middle of the save of the checkpoint of step 20 (in the first
    attempt; ``dcp_kill_in_save_main.py`` wraps DCP's file writer): after its shards are written
    (``shards``: no ``.metadata``) or, rank 0, after DCP's ``.metadata`` (``metadata``: ``DCPSaver``'s
    rename, Lightning's ``meta.pt`` not yet). Its peers, blocked in the save's collective, fail
    together; the next attempt's ``latest_checkpoint`` skips the half-written directory (named in a
    warning) and every rank resumes from the checkpoint of step 10, which the torn save left intact:
    the final weights are bit for bit an uninterrupted run's."""
    example, extra, _ = FORMS[form]
    expected = reference(example, world)
    restarts = "" if in_place else "--max-restarts 1 "
    line = (f"KILL_IN_SAVE=rank={victim},step=20,at={at} torchrun --standalone --nproc-per-node {world} {restarts}"
            f"examples/{KILL_IN_SAVE.name} {example}{' --in-place' if in_place else ''}{extra}")
    returncode, out = _run(line, KILL_IN_SAVE, tmp_path)
    assert f"[rank {victim}] killing itself in the save of {torn} ({at})" in out, out[-4000:]  # it fired there
    assert re.search(rf"skipping {re.escape(torn)}: ", out), out[-4000:]  # the torn directory, seen and skipped
    if in_place:
        assert "recovering in place, attempt 1" in out, out[-4000:]
    resumed = ("resumed from checkpoint_10 at iteration 10" if form == "ignite"
               else rf"resuming from epoch=\d-step=10\.ckpt")
    _check_resumed(out, returncode, world, resumed, expected)


# -- a killed rank's shard from its partner's copy (FTH_SHARD_REPLICAS) ----------------------------------

FLIP_COPY_MAIN = ROOT / "tests" / "programs" / "flip_copy_main.py"


def _replicated_kill_line(world: int, victim: int, example: Path = IGNITE) -> str:
    return _line(example, True, world=world).replace(
        "FTH_INJECT=raise@rank=1,iteration=17", f"FTH_SHARD_REPLICAS=1 FTH_INJECT=kill@rank={victim},iteration=23")


@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long), pytest.param(8, marks=pytest.mark.long),
                                   pytest.param(16, marks=pytest.mark.long)])
def test_ignite_fsdp_in_place_a_killed_ranks_shard_comes_back_from_its_partners_copy(world, reference, tmp_path):
    """``FTH_SHARD_REPLICAS=1``: every rank's shard is copied into its partner's CPU memory after each
    iteration (off the training thread), and each iteration starts once the partners acknowledged the
    copy of the one before (bounded). Rank 0 is SIGKILLed as iteration 23 starts: its keeper replaces
    it, rank 0's shard of iteration 22 comes from its partner's copy (checksum checked), sent over the
    recovery's group, and every rank carries on from 22 (0 steps computed twice) with the
    uninterrupted run's final weights. Before the acknowledgement, at 2 ranks the copy of 22 had not
    arrived when the kill came (a batch fetch after it was handed over): every rank carried on from
    21; before the copies, every rank went back to ``checkpoint_20``."""
    # 160 samples in batches of 4 per rank, 3 epochs: 60 iterations at 2 ranks, 15 at 8, 9 at 16
    _check_from_partners_copy(IGNITE, world, reference, tmp_path, at={2: 23, 4: 23, 8: 13, 16: 7}[world])


def _check_from_partners_copy(example: Path, world: int, reference, tmp_path: Path, at: int = 23,
                              victim: int = 0, extra: str = "") -> None:
    """Rank ``victim`` SIGKILLed as step ``at`` starts: every rank carries on from ``at - 1`` exactly."""
    expected = reference(example, world)
    unit, holder, step = ("global step" if example == LIGHTNING else "iteration"), (victim + 1) % world, at - 1
    returncode, out = _run(_replicated_kill_line(world, victim, example).replace("iteration=23", f"iteration={at}")
                           + extra, example, tmp_path)
    assert f"FTH_INJECT=kill@rank={victim},iteration={at}: injecting kill" in out, out[-4000:]  # the fault fired
    assert f"[rank {victim}] the training process of rank {victim}" in out, out[-4000:]  # its keeper replaced it
    # one host: a rank's partner is the next rank (logged: a lost host would lose both)
    assert re.search(rf"shard replicas: {world} of {world} copies are held on their own rank's host", out), out[-4000:]
    # every copy was acknowledged in time until the kill, the killed rank's own to the end. After the
    # kill a survivor's copy still in flight is not held (a copy sent to the killed rank is lost with it;
    # one sent to a survivor whose gloo connections the failure's release closed fails), and its sender
    # says so: harmless, a survivor resumes from its own capture
    injected = out.index(f"FTH_INJECT=kill@rank={victim},iteration={at}: injecting kill")
    assert "is not held by rank(s)" not in out[:injected], out[:injected][-4000:]
    assert not re.search(rf"\[rank {victim}[^\]]*\] shard replicas: the copy of step \d+ is not held", out), \
        out[-4000:]
    assert re.search(rf"\[rank {victim}[^\]]*\] live state: received its shard of {unit} {step} from rank {holder}'s "
                     r"copy \(CRC-32 [0-9a-f]{8}, checked\)", out), out[-4000:]
    assert re.search(rf"live state, {unit} {step} \(rank {victim}: its shard of {unit} {step} from "
                     rf"rank {holder}'s copy", out), out[-4000:]
    for rank in range(world):
        assert re.search(rf"\[rank {rank}[^\]]*\] carries on from live state, {unit} {step} .*no step computed twice",
                         out), (rank, out[-4000:])
    _check_resumed(out, returncode, world, rf"resuming from live-state-step={step}\.pt" if example == LIGHTNING
                   else rf"resumed from live-state-step={step}\.pt at iteration {step}", expected)


@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("distributed, world", [
    pytest.param(False, 2, id="file-2"), pytest.param(True, 2, id="directory-2", marks=pytest.mark.long),
    pytest.param(False, 4, id="file-4", marks=pytest.mark.long),
    pytest.param(False, 8, id="file-8", marks=pytest.mark.long)])
def test_lightning_model_parallel_in_place_a_killed_ranks_shard_comes_back_from_its_partners_copy(
        distributed, world, reference, tmp_path):
    """As above, for a user's Lightning script (``ModelParallelStrategy``, a real ``Trainer``): rank 1 is
    SIGKILLed as global step 23 starts, mid-epoch; its replacement loads its shard of step 22 (with its
    RNG states) from rank 0's copy through ``fit(ckpt_path=latest_checkpoint(...))``, and every rank
    carries on at 22 (0 steps computed twice) with the uninterrupted run's final weights, in either
    checkpoint form (and at 4 ranks, ``long``). Before, Lightning replicated nothing: rank 1's shard
    was lost with it, and every rank went back to the checkpoint of step 20."""
    _check_from_partners_copy(LIGHTNING, world, reference, tmp_path, victim=1, at=23 if world < 8 else 13,
                              extra=" --distributed" if distributed else "")


@pytest.mark.long
@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("example", [IGNITE, LIGHTNING], ids=["ignite", "lightning"])
@pytest.mark.parametrize("world", [8, 16])
def test_a_healthy_8_rank_sharded_job_with_copies_on_busy_cores_ends_as_an_uninterrupted_one(example, world, reference,
                                                                                                tmp_path):
    """``FTH_SHARD_REPLICAS=1`` at 8 and 16 ranks, no fault, both cores kept busy by 2 other processes:
    every rank copies its shard to its partner after each step and waits (bounded) for the copy of
    the step before; a slow answer is never a failure. The job ends 0 with nothing declared, no copy
    reported missing or refused, and the final weights of the same job without copies."""
    expected = reference(example, world)
    line = _line(example, True, world=world).replace("FTH_INJECT=raise@rank=1,iteration=17", "FTH_SHARD_REPLICAS=1")
    with cpu_hogs(2):
        returncode, out = _run(line, example, tmp_path)
    assert returncode == 0, out[-4000:]
    assert not DECLARATIONS.search(out), out[-4000:]
    # copies were made (the one-host layout is said once per rank), and none went missing or was refused
    assert re.search(rf"shard replicas: {world} of {world} copies are held on their own rank's host", out), out[-4000:]
    assert not re.search(rf"shard replicas: (?!{world} of {world} copies are held)", out), out[-4000:]
    assert "carries on from" not in out, out[-4000:]  # no recovery happened
    assert _digests(out, world) == {expected}, f"final weights differ from the run without copies:\n{out[-4000:]}"


DROPOUT_MAIN = ROOT / "tests" / "programs" / "dropout_fsdp_main.py"


@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("at", [23, pytest.param(21, marks=pytest.mark.long)], ids=["mid-epoch", "epoch-start"])
def test_a_killed_ranks_shard_comes_back_with_its_rng_so_dropout_goes_on_exactly(at, reference, tmp_path):
    """As above, for a script whose step draws random numbers (dropout, noise on the batch; each rank
    seeded apart): rank 0's replacement gets its RNG states of the iteration before with its shard,
    from the same copy under the same checksum, and draws the masks the uninterrupted run drew: the
    same final weights, bit for bit. Before, the replacement's RNG was its fresh process's (the
    weights differed). At 21, the first iteration of the second epoch, the loader drew from torch's
    RNG between iteration 20's end and 21's start (its epoch's base seed): the copy of 20 is sent
    again with the RNG as 21 starts, which is what the survivors' own captures hold."""
    _check_from_partners_copy(DROPOUT_MAIN, 2, reference, tmp_path, at)


@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])
def test_a_rank_lost_with_the_partner_holding_its_copy_resumes_from_the_checkpoint_and_says_why(world, reference,
                                                                                                 tmp_path):
    """Ranks 0 and 1 SIGKILLed together as iteration 23 starts (a host of both lost, in a job whose
    partners share it): rank 1 held the only copy of rank 0's shard (one host: a rank's partner is the
    next rank), so rank 0's shard of 22 is held nowhere. Nothing is loaded that was not checked:
    every rank resumes from ``checkpoint_20`` (21 and 22 computed again), the plan naming why, and
    ends with the uninterrupted run's final weights."""
    line = _replicated_kill_line(world, 0).replace("kill@rank=0,iteration=23",
                                                   "kill@rank=0,iteration=23;kill@rank=1,iteration=23")
    returncode, out = _run(line, IGNITE, tmp_path)
    for rank in (0, 1):  # both faults fired, each killed rank replaced by its keeper
        assert f"FTH_INJECT=kill@rank={rank},iteration=23: injecting kill" in out, out[-4000:]
        assert f"[rank {rank}] the training process of rank {rank}" in out, out[-4000:]
    why = ("no rank holds live state (rank 0: its process was replaced" if world == 2 else  # both ranks replaced
           "rank 0 holds no shard of its own (its process was replaced")  # ranks 2 and 3 hold only the others'
    for rank in range(world):
        assert f"[rank {rank}] this attempt starts at iteration 20: from the checkpoint the script loaded (live " \
               f"state could not serve: {why}" in out, (rank, out[-4000:])
    assert "live state: received its shard" not in out, out[-4000:]
    _check_resumed(out, returncode, world, r"resumed from checkpoint_20 at iteration 20", reference(IGNITE, world))


@pytest.mark.timeout(3 * DEADLINE_SEC + 60)
def test_a_partners_copy_whose_bytes_changed_while_held_is_never_loaded(reference, tmp_path):
    """As above, with a byte of rank 1's copy of rank 0's shard flipped while held
    (``flip_copy_main.py``): rank 1 names it (``SnapshotChecksumError``), no other rank holds rank 0's
    shard, and every rank resumes from ``checkpoint_20``, exactly."""
    line = _replicated_kill_line(2, 0).replace("torchrun ", "FLIP_COPY=1 torchrun ").replace(
        f"examples/{IGNITE.name}", f"examples/{FLIP_COPY_MAIN.name} {IGNITE}")
    returncode, out = _run(line, FLIP_COPY_MAIN, tmp_path)
    assert re.search(r"\[rank 1\] flipped a byte of its copy of rank 0's shard of step 2\d", out), out[-4000:]
    assert re.search(r"\[rank 1[^\]]*\] live state: SnapshotChecksumError: the copy of rank 0's shard of iteration "
                     r"2\d held here does not have its checksum", out), out[-4000:]
    assert re.search(r"live state cannot serve: rank 0 holds no shard of its own \(its process was replaced", out), \
        out[-4000:]
    _check_resumed(out, returncode, 2, r"resumed from checkpoint_20 at iteration 20", reference(IGNITE))
