"""The faults of the launcher tests and bench, and what a surviving rank must print.

``idist.Parallel`` (Ignite) and Lightning's ``ddp_spawn`` start the ranks with
``torch.multiprocessing``, whose parent SIGTERMs every other rank as soon as one exits; Lightning's
``ddp`` re-runs the script for rank 1 from rank 0, whose observer thread SIGKILLs every rank (rank 0
too) within 5 s of a child's failed exit; torchrun's agent SIGTERMs the other workers within a
monitor interval (0.1 s) of one failing. A case is (launcher, fault); :func:`run_case` runs it once
on 2 gloo ranks, each rank's stdout and stderr in a file of its own (``OWN_OUTPUT=1``), and
:func:`cause_named` says whether a survivor's own output names the failing rank and its fault with
the remote traceback or the hung stack.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from launch import PROGRAMS, run_ranks, torchrun_root_cause

LAUNCHERS = ("parallel", "ddp_spawn", "lightning_ddp", "torchrun")
#: launcher -> the rank program it runs
SCRIPTS = {"parallel": "ignite_main.py", "ddp_spawn": "lightning_main.py", "lightning_ddp": "lightning_main.py",
           "torchrun": "ignite_main.py"}
TORCHRUN = ["-m", "torch.distributed.run", "--nproc-per-node=2"]
#: fault -> failing rank
FAULTS = {"kill0": 0, "kill1": 1, "raise": 1, "hang": 1}
#: The hang deadline the hang cases use (seconds).
HANG_SEC = 3
#: The hung line both rank programs sleep on.
HUNG_LINE = "time.sleep(1000)  # the hung line the report must show"
#: launcher -> what the failing rank raises, and the line of the rank program that raises it
RAISED = {
    "parallel": ("RuntimeError: CUDA-like failure at iteration 3", "fault(RuntimeError("),
    "ddp_spawn": ("RuntimeError: CUDA-like failure at step 10", "f.fire(RuntimeError("),
}
RAISED["torchrun"] = RAISED["parallel"]
RAISED["lightning_ddp"] = RAISED["ddp_spawn"]


@dataclass
class CaseRun:
    launcher: str
    fault: str
    failing: int
    pids: dict[int, int]
    outputs: dict[int, str]  # rank -> its own stdout and stderr
    parent: str  # what the launcher's process printed
    returncode: int | None

    @property
    def survivors(self) -> list[int]:
        return [r for r in (0, 1) if r != self.failing]


def _env(launcher: str, fault: str) -> dict[str, str]:
    failing = FAULTS[fault]
    env = dict(FAULT_RANK=str(failing), LINGER="0", OWN_OUTPUT="1", USE_FT="1", RERAISE="1")
    kind = {"kill0": "kill", "kill1": "kill"}.get(fault, fault)
    if SCRIPTS[launcher] == "ignite_main.py":
        env.update(FAULT={"raise": "step"}.get(kind, kind))
        if launcher == "parallel":
            env["LAUNCH"] = "parallel"
        if fault == "hang":
            env["HANG"] = str(HANG_SEC)
    else:
        env.update(LAUNCH="ddp" if launcher == "lightning_ddp" else "ddp_spawn", FTH_TEST_TOP="1", OEC="0", FAULT=kind)
        if fault == "hang":
            env["FTH_HANG_TIMEOUT_SEC"] = str(HANG_SEC)
    return env


def run_case(launcher: str, fault: str, tmp_path: Path, deadline: float = 150.0) -> CaseRun:
    if launcher not in LAUNCHERS or fault not in FAULTS:
        raise ValueError(f"case ({launcher!r}, {fault!r}): launcher one of {LAUNCHERS}, fault one of {tuple(FAULTS)}")
    script = PROGRAMS / SCRIPTS[launcher]
    outdir = tmp_path / f"{script.stem}-1"
    try:
        # ddp: rank 1 is rank 0's child, and outlives it when rank 0 is killed: waited for too
        results = run_ranks(1, "", tmp_path, script=script, env=_env(launcher, fault), result_ranks=2,
                            deadline=deadline, launcher=TORCHRUN if launcher == "torchrun" else None,
                            wait_sessions=launcher == "lightning_ddp")
    finally:
        if launcher == "torchrun":
            _kill_workers(outdir, script.name)
    pids, outputs = {}, {}
    for r in results:
        starts = [e for e in r.events if e.get("event") == "start" and e.get("pid")]
        if starts:
            pids[r.rank] = int(starts[-1]["pid"])
        path = outdir / f"rank{r.rank}.out"
        outputs[r.rank] = path.read_text(errors="replace") if path.exists() else ""
    return CaseRun(launcher, fault, FAULTS[fault], pids, outputs, results[0].stderr, results[0].returncode)


def _kill_workers(outdir: Path, program: str) -> None:
    """torchrun starts every worker in a session of its own: kill, by pid, any still running (with
    its session: liveness helper, DataLoader workers), once the job is over."""
    for rank in (0, 1):
        for e in events(outdir / f"rank{rank}.jsonl"):
            pid = e.get("pid") if e.get("event") == "start" else None
            if not isinstance(pid, int):
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if program.encode() not in f.read():
                        continue
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                continue


def missing(run: CaseRun, rank: int) -> list[str]:
    """What survivor ``rank``'s own output lacks of the cause (empty: it names it in full)."""
    out, f = run.outputs.get(rank, ""), run.failing
    wanted: list[str] = []
    if run.fault in ("kill0", "kill1"):
        pid = run.pids.get(f)
        wanted += [f"rank {f} (pid {pid} on ", "lost: killed by SIGKILL"]
    elif run.fault == "raise":
        text, line = RAISED[run.launcher]
        wanted += [f"rank {f} failed", text, f"Traceback of rank {f}", line]
    else:
        wanted += [f"RankHung: rank {f} (pid ", " hung: ", f"Main thread stack of rank {f}", HUNG_LINE]
    return [w for w in wanted if w not in out]


def cause_named(run: CaseRun) -> bool:
    """Every survivor's own output names the cause in full."""
    return all(not missing(run, r) for r in run.survivors)


def parent_names_cause(run: CaseRun) -> bool | None:
    """The launcher's final error leads to the failing rank and its fault: torch's parent error
    (``mp.spawn``), torchrun's Root Cause. ``None`` for Lightning ``ddp``, whose launcher is rank 0."""
    f = run.failing
    text = run.parent
    if run.launcher == "lightning_ddp":
        return None
    if run.launcher == "torchrun":
        rank, block = torchrun_root_cause(text)
        wanted = {"kill0": "SIGKILL", "kill1": "SIGKILL", "raise": RAISED[run.launcher][0], "hang": "RankHung"}
        return rank == f and wanted[run.fault] in block
    if run.fault in ("kill0", "kill1"):  # torch's own message, or a survivor's report it raises
        return (f"process {f} terminated with signal SIGKILL" in text
                or (f"rank {f} (pid {run.pids.get(f)} on " in text and "killed by SIGKILL" in text))
    if run.fault == "raise":
        return RAISED[run.launcher][0] in text
    return f"RankHung: rank {f} (pid {run.pids.get(f)} on " in text and " hung: " in text


def parent_names_kill(run: CaseRun) -> bool | None:
    """For a SIGKILL under ``mp.spawn``: the parent's error names the killed rank, its pid and the
    signal (the rank's liveness helper wrote torch's error file, or a survivor's report is raised)
    rather than only ``process 1 terminated with signal SIGKILL``. ``None`` for other cases."""
    if run.fault not in ("kill0", "kill1") or run.launcher not in ("parallel", "ddp_spawn"):
        return None
    f = run.failing
    return f"rank {f} (pid {run.pids.get(f)} on " in run.parent and "killed by SIGKILL" in run.parent


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
