"""Benchmark: from a fault to the first trained step of the next attempt: recovered in place, relaunched
and resumed, relaunched from scratch.

    .venv/bin/python bench/resume.py                 # 3 runs per framework x mode
    .venv/bin/python bench/resume.py --reps 5 --fault raise --modes inplace,resume
    .venv/bin/python bench/resume.py --reps 5 --fault hang --modes inplace,resume   # hang_timeout 3 s
    .venv/bin/python bench/resume.py --fault raise --modes inplace,inplace-ckpt,resume --checkpoint-every 10,100,1000
    .venv/bin/python bench/resume.py --fault kill --modes inplace,inplace-ckpt --state-mb 100   # live state sent

Each run is ``torchrun --standalone --nproc_per_node N --max-restarts 2 tests/resume_main.py`` (N from
``--worlds``, 2 by default; ``--worlds 2,4,8`` puts the world sizes side by side)
(``DistributedSampler(shuffle=True, seed=0)``, batch 4 per rank, one epoch of the fault's iteration
+ 13 iterations, a checkpoint every ``--checkpoint-every`` iterations (10 by default; a comma-separated
list puts intervals side by side), ``FaultTolerance`` attached) with rank 1 failing in the first
attempt 0.7 of an interval after a checkpoint, at iteration 37 or later (37 with a checkpoint every
10, 170 every 100, 1700 every 1000; ``--fault kill``: SIGKILL, the default; ``raise``).
``resume`` restarts from ``latest_checkpoint``; ``scratch`` restarts from iteration 0; ``inplace``
(``INPLACE=2``: ``recover_in_place``, torchrun ``--max-restarts 0``) recovers in the same processes and
carries on from the ranks' live state at the last completed iteration (a SIGKILLed rank's new process
is sent a survivor's; ``--state-mb`` sets the state's size); ``inplace-ckpt`` the same with
``FTH_LIVE_STATE=0``: from the newest checkpoint. ``--fault hang`` sets ``FTH_HANG_TIMEOUT_SEC=3``.
``--fault lose --spares K`` (in place only) launches K spare ranks more (``SPARES=K``) and loses rank 1
with no process to come back in (``FTH_INJECT=lose@...``): a spare takes its place and is sent a
survivor's live state; a third table gives the spare's figures: its takeover (the failure reaching a
survivor -> the re-formed group, from its log line), the live state sent, and what it cost while it
waited (CPU and resident memory, sampled from ``/proc`` between the training's first step and the
fault, beside training rank 0's memory).

Prints, per world size, framework and mode, medians and [min, max] over the runs of:
* ``fault -> first step``: from the start of the failing iteration on rank 1 (the end of the last
  step it trained, from the script's trace) to the later of the two ranks' first trained step of
  the second attempt: detection, exit, torchrun's restart, imports, process group, checkpoint
  load, DataLoader workers, first batch;
* ``recomputed``: iterations trained again (last iteration of attempt 0 - start of attempt 1);
* ``fault -> failed step again``: to the later of the two ranks' training of the failed iteration in
  the second attempt (after the recomputed ones);
* the part of the first figure spent before the new processes started (detection, exit, torchrun's
  restart) and in their Python imports (torch, the framework), which depend on the machine's load;
  in place: before the training function was called again (detection, agreement, teardown, the
  group re-formed) and from that call to the first step (the framework's start, the checkpoint, the
  DataLoader workers).
In place, a second table breaks the recovery down per phase, from each rank's log line (the
slowest rank's figure per phase: watchdogs stopped, agreed, torn down, re-formed, each counted from
when the failure reached that rank), so that the part that grows with the world is visible.
Targets: resumed <= 15 s after the fault, recomputed <= the checkpoint interval (10); in place,
<= 1.5 s for a raise (<= 3 s worst), hang_timeout + 1.5 s for a hang, <= 3 s for a SIGKILL (the killed
rank's process replaced by its keeper: the figures "called again" are then the replacement's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from launch import kill_workers  # noqa: E402 - the tests' harness

from fault_tolerant_handlers.core import procfs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "resume_main.py"
DEADLINE = 180


def fault_at(every: int) -> int:
    """0.7 of an interval after a checkpoint, at iteration 37 or later (37, 170, 1700 for 10, 100, 1000)."""
    k = 1
    while k * every + (7 * every + 9) // 10 < 37:
        k += 1
    return k * every + (7 * every + 9) // 10


HANG_TIMEOUT = 3


#: ``[rank R] recovering in place, ...; watchdogs stopped A s, agreed B s, torn down C s (...), re-formed D s``
PHASES = re.compile(r"\[rank (\d+)\] recovering in place, .*; watchdogs stopped ([\d.]+) s, agreed ([\d.]+) s, "
                    r"torn down ([\d.]+) s .*re-formed ([\d.]+) s")


#: ``spare launched rank S on host H took the place of lost rank R (...): X s from the failure reaching a survivor``
TOOK = re.compile(r"took the place of lost rank \d+ .*: ([\d.]+) s from the failure reaching a survivor")
#: ``... torn down C s (..., live state sent X, ...)``
SENT = re.compile(r"live state sent ([\d.]+)")


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (fields 14 and 15 of its ``stat``), seconds."""
    fields = procfs.stat_fields(pid)
    return None if fields is None or len(fields) <= 12 else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sample(pid: int) -> tuple[float, float] | None:
    """``(CPU seconds, resident MB)`` of ``pid`` now, or ``None`` once it is gone."""
    cpu = _cpu_seconds(pid)
    try:
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return None if cpu is None else (cpu, rss / 1024)


def _watch_spares(out: Path, world: int, spares: int, stop: threading.Event, samples: dict) -> None:
    """Every 0.2 s until ``stop``: ``(wall time, CPU s, RSS MB)`` of each launched spare and of rank 0."""
    while not stop.wait(0.2):
        for launched in [0, *range(world, world + spares)]:
            try:
                pid = json.loads((out / f"process_launched{launched}.json").read_text())["pid"]
            except (OSError, ValueError, KeyError):
                continue
            got = _sample(pid)
            if got is not None:
                samples.setdefault(launched, []).append((time.time(), *got))


def _idle_cost(samples: dict, world: int, spares: int, since: float, until: float) -> dict:
    """The spares' CPU (% of a core) and memory while they waited (``since`` -> ``until``), and rank 0's memory."""
    cpu, rss = [], []
    for launched in range(world, world + spares):
        idle = [s for s in samples.get(launched, []) if since <= s[0] <= until]
        if len(idle) >= 2 and idle[-1][0] > idle[0][0]:
            cpu.append(100 * (idle[-1][1] - idle[0][1]) / (idle[-1][0] - idle[0][0]))
            rss.append(idle[-1][2])
    trainer = [s for s in samples.get(0, []) if since <= s[0] <= until]
    return {"spare_cpu": max(cpu) if cpu else float("nan"), "spare_mb": max(rss) if rss else float("nan"),
            "rank0_mb": trainer[-1][2] if trainer else float("nan")}


def one_run(framework: str, mode: str, fault: str, out: Path, world: int = 2, every: int = 10, hidden: int = 0,
            spares: int = 0) -> dict:
    out.mkdir(parents=True)
    at = fault_at(every)
    # one epoch of at + 13 iterations at any world size (batch 4 per rank): 50 with a checkpoint every 10
    env = dict(os.environ, PYTHONPATH=str(ROOT), EVERY=str(every), EPOCHS="1", SAMPLES=str(4 * world * (at + 13)),
               RESUME="0" if mode == "scratch" else "1",
               FTH_INJECT=f"{fault}@rank=1,iteration={at}", PG_TIMEOUT_SEC="20", PYTHONUNBUFFERED="1",
               INPLACE="2" if mode.startswith("inplace") else "", FTH_LIVE_STATE="0" if mode == "inplace-ckpt" else "1",
               HIDDEN=str(hidden), SPARES=str(spares))
    if fault == "hang":
        env["FTH_HANG_TIMEOUT_SEC"] = str(HANG_TIMEOUT)
    samples: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_spares, args=(out, world, spares, stop, samples), daemon=True)
    if spares:
        watcher.start()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world + spares),
           "--max-restarts", "0" if mode.startswith("inplace") else "2", "--monitor-interval", "0.5", str(SCRIPT), framework, str(out)]
    with open(out / "log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=DEADLINE + at // 20)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and everything it started
            except ProcessLookupError:
                pass
            proc.wait()
            kill_workers(out)
            stop.set()
    if proc.returncode != 0:
        raise RuntimeError(f"{framework}/{mode}: torchrun exited {proc.returncode}; see {out / 'log'}")
    trace = [json.loads(line) for line in (out / "batches1.jsonl").read_text().splitlines()]
    first = [json.loads((out / f"attempt1_rank{r}.json").read_text()) for r in range(world)]
    last0 = [e for e in trace if e["attempt"] == 0][-1]
    step_sec = statistics.median(b["t"] - a["t"] for a, b in zip(trace, trace[1:]) if a["attempt"] == b["attempt"] == 0)
    fault_t = last0["t"] + step_sec  # the failing iteration starts one step after the last traced one
    recalled = min(f["marks"]["imported"] for f in first)  # in place: the training function called again
    in_place = first[0]["pid"] == json.loads((out / "attempt0_rank0.json").read_text())["pid"]
    # in place, rank 0 keeps its process (rank 1's is replaced after a kill)
    assert in_place == mode.startswith("inplace"), f"{mode}: attempt 1 ran in {'the same' if in_place else 'a new'} process"
    # in place: each rank's phases after the failure reached it (the slowest rank's, per phase)
    phases = [tuple(float(x) for x in m.groups()[1:]) for m in PHASES.finditer((out / "log").read_text())]
    phase = {name: max(p[i] for p in phases) if phases else float("nan")
             for i, name in enumerate(("stopped", "agreed", "torn_down", "reformed"))}
    if spares:
        text = (out / "log").read_text()
        took = [float(m.group(1)) for m in TOOK.finditer(text)]
        sent = [float(m.group(1)) for m in SENT.finditer(text)]
        zero = json.loads((out / "attempt0_rank0.json").read_text())
        phase.update(_idle_cost(samples, world, spares, zero["first_step_at"], fault_t),
                     took=max(took) if took else float("nan"), sent=max(sent) if sent else float("nan"))
    return {"resume_sec": max(f["first_step_at"] for f in first) - fault_t, **phase,
            "restart_sec": (recalled if in_place else min(f["started_at"] for f in first)) - fault_t,
            "import_sec": max(f["first_step_at"] for f in first) - recalled if in_place else
            max(f["marks"]["imported"] - f["started_at"] for f in first),
            "recomputed": last0["step"] - first[0]["start_iteration"],
            "again_sec": max(again_at(out / f"batches{r}.jsonl", at) for r in range(world)) - fault_t,
            "start_iteration": first[0]["start_iteration"], "load": os.getloadavg()[0]}


def again_at(trace: Path, step: int) -> float:
    """When the second attempt trained ``step`` (the failed iteration) on this rank."""
    return next(e["t"] for e in map(json.loads, trace.read_text().splitlines()) if e["attempt"] == 1 and e["step"] == step)


def summary(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fault", choices=["kill", "raise", "hang", "lose"], default="kill")
    parser.add_argument("--spares", type=int, default=0,
                        help="spare ranks launched beside the world (--fault lose: at least 1; in place only)")
    parser.add_argument("--frameworks", default="ignite,lightning")
    parser.add_argument("--worlds", default="2", help="comma-separated world sizes (ranks), e.g. 2,4,8")
    parser.add_argument("--modes", default="resume,scratch",
                        help="comma-separated, from inplace (recover_in_place, live state), inplace-ckpt (recover_in_place, "
                             "FTH_LIVE_STATE=0), resume, scratch")
    parser.add_argument("--state-mb", type=float, default=0,
                        help="the model's size: Linear(8, n), Tanh, Linear(n, 1) with n such that its parameters (the "
                             "whole state: SGD without momentum) take this many MB; 0: Linear(8, 1)")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep every run's records and logs under DIR (one folder per run) instead of a temporary folder")
    parser.add_argument("--checkpoint-every", default="10",
                        help="comma-separated checkpoint intervals (iterations), e.g. 10,100,1000")
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - set(NAMES)
    if unknown:
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(NAMES)}")
    try:
        intervals = [int(e) for e in args.checkpoint_every.split(",")]
    except ValueError:
        intervals = [0]
    if min(intervals) < 1:
        parser.error(f"--checkpoint-every: positive ints (iterations), comma-separated; got {args.checkpoint_every!r}")
    if args.state_mb < 0:
        parser.error(f"--state-mb: a size in MB >= 0; got {args.state_mb}")
    args.hidden = int(args.state_mb * 2**20 / 4 / 10) if args.state_mb else 0  # 10 floats per hidden unit
    if args.spares < 0 or (args.fault == "lose") != (args.spares > 0):
        parser.error(f"--spares {args.spares}: --fault lose needs --spares >= 1 (a spare takes the lost rank's place), "
                     "and the other faults run without spares")
    if args.fault == "lose" and set(args.modes.split(",")) - {"inplace", "inplace-ckpt"}:
        parser.error(f"--fault lose --modes {args.modes}: spares recover in place only (inplace, inplace-ckpt)")
    worlds = [int(w) for w in args.worlds.split(",")]
    if min(worlds) < 2:
        parser.error("--worlds: every world size must be >= 2 (rank 1 fails)")
    results: dict[tuple, list[dict]] = {}
    failed: dict[tuple, list[str]] = {}
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="fth-bench-resume-"))
        for rep in range(args.reps):
            for every in intervals:
                for world in worlds:
                    for framework in args.frameworks.split(","):
                        modes = args.modes.split(",")
                        for mode in (modes if rep % 2 == 0 else modes[::-1]):
                            run_once(results, failed, (every, world, framework, mode), rep, args.fault,
                                     Path(tmp) / f"{framework}-{mode}-{world}-{every}-{rep}", args.hidden, args.spares)
    report(results, failed, args)


def run_once(results: dict, failed: dict, key: tuple, rep: int, fault: str, out: Path, hidden: int = 0,
             spares: int = 0) -> None:
    every, world, framework, mode = key
    try:
        res = one_run(framework, mode, fault, out, world, every, hidden, spares)
    except Exception as err:  # noqa: BLE001 - a run that did not recover is a result too
        failed.setdefault(key, []).append(f"run {rep + 1}: {err}")
        print(f"  every {every} {world} ranks {framework:9s} {mode:12s} run {rep + 1}: FAILED: {err}", flush=True)
        return
    results.setdefault(key, []).append(res)
    inplace = mode.startswith("inplace")
    print(f"  every {every} {world} ranks {framework:9s} {mode:12s} run {rep + 1}: fault -> first step "
          f"{res['resume_sec']:.2f} s ({'called again' if inplace else 'new processes started'} after "
          f"{res['restart_sec']:.2f} s, then {res['import_sec']:.2f} s "
          f"{'to the first step' if inplace else 'of imports'}), recomputed {res['recomputed']}, the failed step "
          f"again {res['again_sec']:.2f} s after the fault, load average {res['load']:.1f}", flush=True)


NAMES = {"resume": "relaunch, from latest_checkpoint", "scratch": "relaunch, from scratch",
         "inplace": "in place (recover_in_place), from live state", "inplace-ckpt": "in place, from the newest checkpoint "
         "(FTH_LIVE_STATE=0)"}


def report(results: dict, failed: dict, args) -> None:
    size = f"state {args.hidden * 10 * 4 / 2**20:.0f} MB (HIDDEN={args.hidden})" if args.hidden else "state 36 bytes"
    print(f"\nfault={args.fault}, 0.7 of a checkpoint interval after a checkpoint, {size}, {args.reps} runs each "
          "(median [min, max])")
    print("| checkpoint every | fault at | ranks | framework | restart | fault -> first trained step (s) | fault -> new "
          "processes, or the call again in place (s) | their imports, or that call -> first step in place (s) | "
          "iterations recomputed | fault -> failed step trained again (s) |")
    print("|---:|---:|---|---|---|---:|---:|---:|---:|---:|")
    for (every, world, framework, mode), runs in sorted(results.items()):
        print(f"| {every} | {fault_at(every)} | {world} | {framework} | {NAMES[mode]} | "
              f"{summary([r['resume_sec'] for r in runs], '.2f')} | {summary([r['restart_sec'] for r in runs], '.2f')} | "
              f"{summary([r['import_sec'] for r in runs], '.2f')} | {summary([r['recomputed'] for r in runs], 'g')} | "
              f"{summary([r['again_sec'] for r in runs], '.2f')} |")
    inplace_rows = [((world, framework, every, mode), runs) for (every, world, framework, mode), runs
                    in sorted(results.items()) if mode.startswith("inplace")]
    if inplace_rows:
        print("\nIn place, per phase: seconds after the failure reached each rank, the slowest rank's, then the "
              "call again -> the slowest rank's first step (median [min, max])")
        print("| ranks | framework | checkpoint every | state | watchdogs stopped | agreed | torn down | re-formed | "
              "call -> first step | fault -> first step |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for (world, framework, every, mode), runs in inplace_rows:
            cells = " | ".join(summary([r[p] for r in runs], ".2f") for p in ("stopped", "agreed", "torn_down", "reformed"))
            state = "live" if mode == "inplace" else "checkpoint"
            print(f"| {world} | {framework} | {every} | {state} | {cells} | {summary([r['import_sec'] for r in runs], '.2f')} | "
                  f"{summary([r['resume_sec'] for r in runs], '.2f')} |")
    if args.spares:
        print(f"\nSpares ({args.spares} launched beside the world): the takeover, the failure reaching a survivor -> the "
              "re-formed group (the spare's log line); the live state sent to it (the slowest rank's); while it "
              "waited, its CPU (% of a core) and resident memory, beside training rank 0's (median [min, max])")
        print("| ranks | framework | takeover (s) | live state sent (s) | fault -> first trained step (s) | idle spare "
              "CPU (%) | idle spare RSS (MB) | training rank 0 RSS (MB) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for (world, framework, every, mode), runs in inplace_rows:
            cells = " | ".join(summary([r[p] for r in runs], f) for p, f in
                               (("took", ".2f"), ("sent", ".2f"), ("resume_sec", ".2f"), ("spare_cpu", ".2f"),
                                ("spare_mb", ".0f"), ("rank0_mb", ".0f")))
            print(f"| {world} + {args.spares} | {framework} | {cells} |")
    for (every, world, framework, mode), why in sorted(failed.items()):
        print(f"FAILED every {every} {world} ranks {framework} {mode}: {len(why)} run(s): {'; '.join(why)}")
    print(f"load average during the runs: {summary([r['load'] for rs in results.values() for r in rs], '.1f')} "
          f"on {os.cpu_count()} CPUs")
    ok = all(r["resume_sec"] <= 15 and r["recomputed"] <= every
             for (every, _, _, mode), runs in results.items() if mode == "resume" for r in runs)
    print(f"\ntargets (resumed <= 15 s, recomputed <= the checkpoint interval): {'met' if ok else 'NOT met'} in every "
          "resumed run")
    live = [r for (_, _, _, mode), runs in results.items() if mode == "inplace" for r in runs]
    if live and args.fault != "kill":
        print(f"target in place from live state (0 iterations recomputed): "
              f"{'met' if all(r['recomputed'] == 0 for r in live) else 'NOT met'} in every run")
    for world in sorted({key[1] for key in results}):
        inplace = [r for (every, w, _, mode), runs in results.items() if w == world and mode.startswith("inplace")
                   for r in runs]
        if not inplace:
            continue
        median_target, worst_target = {"raise": (1.5, 3), "hang": (HANG_TIMEOUT + 1.5, HANG_TIMEOUT + 3),
                                       "kill": (3, 3), "lose": (3, 3)}[args.fault]
        med, worst = statistics.median(r["resume_sec"] for r in inplace), max(r["resume_sec"] for r in inplace)
        ok = med <= median_target and worst <= worst_target
        print(f"targets in place at {world} ranks (fault -> first step: median <= {median_target:g} s, worst <= "
              f"{worst_target:g} s): {'met' if ok else 'NOT met'} (median {med:.2f} s, worst {worst:.2f} s)")


if __name__ == "__main__":
    main()
