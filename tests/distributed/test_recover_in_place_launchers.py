"""``recover_in_place`` under the launchers other than torchrun with the job's own
``init_process_group``: Ignite's ``idist.Parallel`` (spawning its ranks, and under torchrun, in both
shapes users write) and Lightning's ``strategy="ddp"`` (``python script.py``: rank 0 starts rank 1).

Each job trains 2 gloo ranks for 50 iterations (``inplace_launchers_main.py``; 2 DataLoader workers
under Lightning and in one torchrun case, none where ``idist.Parallel`` spawns the ranks: its ranks'
workers would be spawned too, seconds each), checkpoints every 10, and rank 1 raises at iteration 37
in the first attempt only (``FTH_INJECT``). Every rank must
recover in its own process (the same pid in attempt 0 and 1, no process started again), resume from
its live state at iteration 36 (the last completed: no iteration trained twice; the Ignite job loads
it with ``Checkpoint.load_objects(to_load, path)``, Lightning's with ``fit(ckpt_path=path)``), train
exactly the rest of an uninterrupted run's batches, and end with its weights (``torch.equal``). Where the recovery wraps the launcher instead of the ranks
(``idist.Parallel(nproc_per_node=...)`` inside it, Lightning ``ddp_spawn``), the job fails at
start, before any batch, with a :class:`RecoveryError` saying what to wrap instead.

Every job runs in its own session under a deadline; its session is killed afterwards, and so are
torchrun's workers (sessions of their own), by the pids they recorded. All ``long``: the default
suite proves recovering in place under torchrun (``test_recover_in_place.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, ROOT, _session_alive, kill_workers

SCRIPT = PROGRAMS / "inplace_launchers_main.py"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            "--monitor-interval", "0.5"]
FAULT = "raise@rank=1,iteration=37"
DEADLINE = 90.0
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_references: dict[str, Path] = {}

pytestmark = pytest.mark.timeout(240)


def run_job(shape: str, out: Path, *, torchrun: bool = False, env: dict[str, str] | None = None,
            deadline: float = DEADLINE) -> tuple[int | None, str, float]:
    """Run the program once (under torchrun, or as ``python script.py``, which launches its ranks
    itself), in its own session; wait for every process of that session (Lightning's rank 1, the
    ranks ``idist.Parallel`` spawns), ``deadline`` seconds at most; kill what is left. Returns its exit
    code (``None``: killed at the deadline), its output and how long it ran."""
    out.mkdir(parents=True, exist_ok=True)
    full = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    full.update(PYTHONUNBUFFERED="1", PG_TIMEOUT_SEC="20", FTH_INJECT="",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    full.update(env or {})
    argv = [sys.executable, *(TORCHRUN if torchrun else []), str(SCRIPT), shape, str(out)]
    start = time.monotonic()
    with open(out / "output.txt", "w+") as log:
        proc = subprocess.Popen(argv, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            end = start + deadline
            while time.monotonic() < end and (proc.poll() is None or _session_alive(proc.pid)):
                time.sleep(0.1)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=10)
            kill_workers(out, SCRIPT.name)  # torchrun's workers lead sessions of their own
        elapsed = time.monotonic() - start
        log.seek(0)
        output = log.read()
    return (proc.returncode if elapsed < deadline else None), output, elapsed


def reference(framework: str, tmp_path_factory) -> Path:
    """An uninterrupted run without recover_in_place (once per framework)."""
    if framework not in _references:
        out = tmp_path_factory.mktemp(f"reference-{framework}")
        if framework == "ignite":
            code, output, _ = run_job("parallel", out, torchrun=True, env={"INPLACE": ""})
        else:
            code, output, _ = run_job("ddp", out, env={"INPLACE": ""})
        assert code == 0, f"the reference run failed ({code}):\n{output[-4000:]}"
        _references[framework] = out
    return _references[framework]


def attempts(out: Path, rank: int) -> dict[int, dict]:
    return {int(p.name[7:p.name.index("_")]): json.loads(p.read_text()) for p in out.glob(f"attempt*_rank{rank}.json")}


def trained(out: Path, rank: int) -> list[dict]:
    path = out / f"batches{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_recovered_in_place(out: Path, ref: Path, output: str) -> dict[int, dict]:
    """Both ranks: attempt 0 failed at the fault, attempt 1 ran in the same process, resumed from the
    live state of iteration 36, trained exactly the uninterrupted run's remaining batches; the weights
    are equal."""
    tries = {rank: attempts(out, rank) for rank in (0, 1)}
    for rank in (0, 1):
        got, want = tries[rank], trained(ref, rank)
        assert set(got) == {0, 1}, f"rank {rank}: attempts {sorted(got)}\n{output[-4000:]}"
        assert got[0]["pid"] == got[1]["pid"], f"rank {rank} did not recover in its own process: {got}"
        assert "done" not in got[0] and got[1]["done"] and got[1]["iteration"] == 50, got
        first = got[1]
        assert first["start_iteration"] == 36 and first["first_step"] == 37, first
        assert Path(first["resumed_from"]).name == "live-state-step=36.pt", first["resumed_from"]
        assert first["resumed_from"] == tries[1 - rank][1]["resumed_from"]
        batches = trained(out, rank)
        steps0 = [e["step"] for e in batches if e["attempt"] == 0]
        assert steps0 == list(range(1, len(steps0) + 1)) and steps0[-1] >= 36, steps0
        rest = [(e["step"], e["idx"]) for e in batches if e["attempt"] == 1]
        assert rest == [(e["step"], e["idx"]) for e in want[36:]], f"rank {rank}: attempt 1 trained other batches"
        assert f"[rank {rank}] recovering in place, attempt 1 (max_restarts=2)" in output, output[-4000:]
    pids = {a["pid"] for rank in (0, 1) for a in tries[rank].values()}
    assert len(pids) == 2, f"a rank process was started again: pids {pids}"
    final, expected = torch.load(out / "weights.pt"), torch.load(ref / "weights.pt")
    for key in expected:
        assert torch.equal(final[key], expected[key]), f"{key} differs from the uninterrupted run's"
    return tries


def assert_idist_follows(tries: dict[int, dict]) -> None:
    """``ignite.distributed`` tells the re-formed group as it told the first: backend, rank, world
    size, local rank, processes per node (its computation model a new object, made as in a fresh
    process: the recovery puts idist back, so that a replaced rank's new process and the survivors
    make the same collectives); and its collectives work over the new group (an all_reduce of the ranks)."""
    for rank, got in tries.items():
        assert got[1]["idist_end"] == got[1]["idist"], got[1]  # still right when the attempt ends
        before, after = dict(got[0]["idist"]), dict(got[1]["idist"])
        assert before.pop("model_id") != after.pop("model_id"), (before, after)
        assert before == after == {"backend": "gloo", "rank": rank, "world_size": 2, "local_rank": rank,
                                   "nproc_per_node": 2, "model": "_NativeDistModel", "dist_rank": rank,
                                   "dist_world_size": 2}, (before, after)
        assert got[1]["all_reduced_ranks"] == 1.0


@pytest.mark.long
def test_idist_parallel_spawn_recovers_in_place(tmp_path, tmp_path_factory):
    """``with idist.Parallel(backend="gloo", nproc_per_node=2) as p: p.run(recover_in_place(training,
    max_restarts=2), out)``: the function is pickled into the spawned ranks; rank 0 hosts the store
    (MASTER_PORT), and the re-formed group is made over that very store."""
    ref = reference("ignite", tmp_path_factory)
    code, output, elapsed = run_job("parallel", tmp_path / "run", env={"FTH_INJECT": FAULT})
    assert code == 0, f"exit {code} after {elapsed:.0f} s:\n{output[-4000:]}"
    tries = assert_recovered_in_place(tmp_path / "run", ref, output)
    assert_idist_follows(tries)


@pytest.mark.long
@pytest.mark.parametrize("shape", ["parallel", "parallel-inside"])
def test_idist_parallel_under_torchrun_recovers_in_place(shape, tmp_path, tmp_path_factory):
    """Under torchrun: ``p.run(recover_in_place(training, ...))`` inside ``idist.Parallel(backend)``
    (the group exists when the recovery starts: it re-makes it), and ``recover_in_place(main)`` where
    ``main`` opens ``idist.Parallel(backend)`` itself (its ``__exit__`` destroys the group on the
    failure path: the recovery finds the first rendezvous's store, and idist a new group)."""
    ref = reference("ignite", tmp_path_factory)
    workers = "2" if shape == "parallel-inside" else "0"  # torn down with the attempt (forked: cheap)
    code, output, elapsed = run_job(shape, tmp_path / "run", torchrun=True,
                                    env={"FTH_INJECT": FAULT, "WORKERS": workers})
    assert code == 0, f"exit {code} after {elapsed:.0f} s:\n{output[-4000:]}"
    tries = assert_recovered_in_place(tmp_path / "run", ref, output)
    assert_idist_follows(tries)


@pytest.mark.long
def test_lightning_ddp_recovers_in_place(tmp_path, tmp_path_factory):
    """``python script.py`` with ``Trainer(strategy="ddp", devices=2)``: rank 0 started rank 1 in the
    first attempt and starts nobody in the second; both recover in their own processes."""
    ref = reference("lightning", tmp_path_factory)
    code, output, elapsed = run_job("ddp", tmp_path / "run", env={"FTH_INJECT": FAULT, "WORKERS": "2"})
    assert code == 0, f"exit {code} after {elapsed:.0f} s:\n{output[-4000:]}"
    tries = assert_recovered_in_place(tmp_path / "run", ref, output)
    assert tries[0][1]["children_started"] == 0 and tries[0][1]["global_rank"] == 0, tries[0][1]


@pytest.mark.long
@pytest.mark.parametrize("shape", ["parallel-inside", "ddp_spawn"])
def test_recovery_around_a_spawning_launcher_fails_at_start(shape, tmp_path):
    """``recover_in_place`` around ``idist.Parallel(nproc_per_node=2)`` or a Lightning ``ddp_spawn``
    fit runs in the parent, which cannot recover a spawned rank in place: every rank fails at start,
    before any batch, naming what to wrap instead, and so does the parent."""
    out = tmp_path / "run"
    code, output, elapsed = run_job(shape, out, env={"FTH_INJECT": FAULT}, deadline=60)
    assert code not in (0, None), f"exit {code} after {elapsed:.0f} s:\n{output[-4000:]}"
    assert "session (Guard) cannot start: recover_in_place runs in the parent process" in output, output[-4000:]
    assert "RecoveryError: recover_in_place wraps a function that spawned the ranks" in output, output[-4000:]
    assert "p.run(recover_in_place(training, max_restarts=N), cfg)" in output
    assert not trained(out, 0) and not trained(out, 1), "a rank trained before the error"
