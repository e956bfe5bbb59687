"""The recovery examples run as their docstrings print them: each ``FTH_INJECT=... torchrun ...`` line
of ``examples/resume_ignite.py`` and ``examples/resume_lightning.py`` (relaunch and resume, and
``--in-place``) on 2 CPU ranks. Rank 1 raises at iteration 14; the next attempt (torchrun's restart,
or a recovery in place) resumes on every rank (a relaunch from the checkpoint of iteration 10, in
place from the live state of 13) and trains to 60, and the job exits 0. Every run is bounded; each is started from a copy of the example in its own
folder, and every process whose command line names that copy is killed by pid afterwards (torchrun
starts each worker in a session of its own). A run still going at its deadline (a stall) first has
each of those processes print its threads' stacks (``launch.dump_stacks``), which the failure shows."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import ROOT, STACKS_ENV, STACKS_MARKER, dump_stacks

DEADLINE_SEC = 150
#: How much of the stacks dumped at the deadline a failure shows (the whole is in ``output.txt``).
MAX_STACKS_CHARS = 40_000
EXAMPLES = {"ignite": ROOT / "examples" / "resume_ignite.py", "lightning": ROOT / "examples" / "resume_lightning.py"}
#: what each rank prints when the next attempt resumes, and when it has trained to the end
RESUMED = {"ignite": "resumed from checkpoint_10.pt at iteration 10", "lightning": "resuming from epoch=0-step=10.ckpt"}
#: In place, from the ranks' live state at the last completed step (the fault is at 14).
RESUMED_IN_PLACE = {"ignite": "resumed from live-state-step=13.pt at iteration 13",
                    "lightning": "resuming from live-state-step=13.pt"}
FINISHED = {"ignite": "finished at iteration 60", "lightning": "finished at step 60"}


def _commands(example: Path) -> list[str]:
    """The rehearsal lines of the example's docstring."""
    text = example.read_text()
    doc = text[: text.index('"""', 3)]
    return [line.strip() for line in doc.splitlines() if line.strip().startswith("FTH_INJECT=")]


def _named(marker: str) -> list[int]:
    """The pids of every process whose command line contains ``marker`` (a path only this test uses)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return sorted(pids)


def _kill_named(marker: str) -> None:
    """SIGKILL, by pid, every process whose command line contains ``marker``."""
    for pid in _named(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _run(line: str, example: Path, tmp_path: Path, deadline: float = DEADLINE_SEC) -> tuple[int | None, str]:
    """Run one printed command line in ``tmp_path``, with the example copied there (a path no other
    process has), torchrun as ``python -m torch.distributed.run``. Returns the exit code (``None``:
    killed at the deadline, the stacks of its processes at the end of the output) and the output."""
    words = shlex.split(line)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTH_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "torchrun", line
    copy = tmp_path / example.name
    shutil.copy(example, copy)
    argv = [sys.executable, "-m", "torch.distributed.run",
            *[str(copy) if w == f"examples/{example.name}" else w for w in words[1:]]]
    assert str(copy) in argv, line
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **STACKS_ENV)
    with open(tmp_path / "output.txt", "w+") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        returncode = None
        try:
            returncode = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:  # a stall: where every process of the job stands, before they go
            dump_stacks(_named(str(copy)), out)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=10)
            time.sleep(0.2)
            _kill_named(str(copy))  # the workers and their children, in sessions of their own
        out.seek(0)
        return returncode, out.read()


CASES = [pytest.param(framework, line, id=f"{framework}-{'in-place' if '--in-place' in line else 'relaunch'}")
         for framework, example in EXAMPLES.items() for line in _commands(example)]


def test_every_example_prints_both_rehearsals():
    assert len(CASES) == 4, CASES
    for framework, example in EXAMPLES.items():
        modes = {"--in-place" in line for line in _commands(example)}
        assert modes == {True, False}, (example, modes)
        assert all("--standalone --nproc-per-node 2" in line for line in _commands(example))


@pytest.mark.timeout(DEADLINE_SEC + 30)
@pytest.mark.parametrize("framework, line", CASES)
def test_example_recovers_and_finishes(framework, line, tmp_path):
    if framework == "lightning":
        pytest.importorskip("lightning")
    else:
        pytest.importorskip("ignite")
    returncode, out = _run(line, EXAMPLES[framework], tmp_path)
    ran, _, stacks = out.partition(STACKS_MARKER)
    assert returncode is not None, (f"still running after {DEADLINE_SEC} s (killed):\n{ran[-4000:]}"
                                    f"{STACKS_MARKER}{stacks[:MAX_STACKS_CHARS]}")
    assert "FTH_INJECT=raise@rank=1,iteration=14: injecting raise" in out, out[-4000:]  # the fault fired
    assert re.search(r"\[rank 0 step \d+\] stopping: rank 1 failed in 'train'", out), out[-4000:]  # rank 0 learnt it
    for rank in (0, 1):
        resumed = (RESUMED_IN_PLACE if "--in-place" in line else RESUMED)[framework]
        assert f"[rank {rank}] attempt 1: {resumed}" in out, out[-4000:]
        assert f"[rank {rank}] {FINISHED[framework]}" in out, out[-4000:]
    if "--in-place" in line:
        assert "recovering in place, attempt 1" in out, out[-4000:]
    assert returncode == 0, out[-4000:]


#: A stall like the one this diagnostic is for: a child forked while another thread held a lock, which
#: it then waits for; its parent waits for the child. Each prints "ready" once where it stays.
_STALL = """
import os, sys, threading, time
held, taken = threading.Lock(), threading.Event()
def holder():
    with held:
        taken.set()
        time.sleep(3600)
threading.Thread(target=holder, daemon=True).start()
taken.wait()
def child_waits_for_a_lock_held_at_fork():
    print("ready", flush=True)
    held.acquire()
def parent_waits_for_its_child(pid):
    print("ready", flush=True)
    os.waitpid(pid, 0)
pid = os.fork()
if pid == 0:
    child_waits_for_a_lock_held_at_fork()
else:
    parent_waits_for_its_child(pid)
"""


def test_a_run_still_going_at_its_deadline_leaves_the_stacks_of_every_process(tmp_path):
    """What ``_run`` does at its deadline: each process (a forked child too) prints where its threads stand."""
    script = tmp_path / "stall.py"
    script.write_text(_STALL)
    with open(tmp_path / "output.txt", "w+") as out:
        proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, **STACKS_ENV}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            end = time.monotonic() + 30
            while Path(out.name).read_text().count("ready") < 2 and time.monotonic() < end:
                time.sleep(0.05)
            pids = _named(str(script))
            assert len(pids) == 2, pids
            dump_stacks(pids, out)
        finally:
            _kill_named(str(script))
            proc.wait(timeout=10)
        out.seek(0)
        ran, _, stacks = out.read().partition(STACKS_MARKER)
    assert ran.count("ready") == 2, ran
    for pid in pids:
        assert f"--- pid {pid} " in stacks, stacks
    assert "in child_waits_for_a_lock_held_at_fork" in stacks, stacks
    assert "in parent_waits_for_its_child" in stacks, stacks
    assert "in holder" in stacks, stacks  # every thread, not only the main one
    assert not list(tmp_path.glob("core*")), "no core dump is left"
