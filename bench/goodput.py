"""Benchmark: goodput under a stream of faults, recovered in place beside the relaunch, in one run.

    .venv/bin/python bench/goodput.py                       # Ignite and Lightning, 4 and 8 ranks, 10 min each
    .venv/bin/python bench/goodput.py --minutes 1 --worlds 4 --frameworks ignite --every 20   # a short check
    .venv/bin/python bench/goodput.py --out goodput.md --plot goodput.png --keep runs/
    .venv/bin/python bench/goodput.py --worlds 8 --every 60 --keep runs/   # a part now; the rest later,
                                                  # the same --keep: finished runs are reused, not re-run

The training is ``tests/resume_main.py`` under ``torchrun --standalone``: a seeded regression
(``HIDDEN=32``), ``DistributedSampler(shuffle=True, seed=0)``, batch 4 per rank, one epoch of
``--minutes`` x 60 s / ``--step-ms`` steps (a step sleeps ``--step-ms``, 50 ms by default, besides its
forward, backward and all-reduce), one DataLoader worker per rank (``RestartableDataLoader``), a
checkpoint every 100 steps (Ignite ``Checkpoint``, Lightning ``ModelCheckpoint``), ``FaultTolerance``
attached with ``hang_timeout`` 5 s (``FTH_HANG_TIMEOUT_SEC``, the one timeout the bench sets: every
other one is at its documented default; torch's process-group timeout is set to its default, 30 min).
Per framework and world size, side by side:

* ``none``: no fault. Its wall time is the reference, and its final weights the exact ones.
* ``inplace``: faults drawn at random (``--seed``; the kinds dealt from a shuffled deck, so that each
  kind comes as often as the others) at one per ``--every`` seconds of training, each a
  ``raise``, a ``kill`` (SIGKILL), a ``hang``, a ``worker-kill`` (SIGKILL of a DataLoader worker) or a
  ``lose`` (a rank lost as if its host went: SIGKILLed, never replaced; one spare rank launched per
  ``lose`` in the draw), on a rank drawn at random, recovered in place (``recover_in_place``,
  ``INPLACE``) from the ranks' live state.
* ``relaunch``: the same faults, what a user has without recovering in place: ``torchrun
  --max-restarts`` relaunches every rank, and each resumes from ``latest_checkpoint`` (every 100 steps).
  A ``lose`` is a ``kill`` there (the relaunch starts a new process in its place); a ``worker-kill``
  is survived by ``RestartableDataLoader`` in both.

The schedule is drawn ahead as ``(kind, rank, iteration, attempt)``: fault ``j`` at an iteration drawn
in the middle half of the ``j``-th window of ``--every`` s / ``--step-ms`` iterations, firing in the
attempt it is reached in (``FTH_INJECT``'s ``attempt=N``: torchrun's restarts plus the recoveries in
place before it; a ``worker-kill`` starts no new attempt).

Per run: the training efficiency (the reference's wall time / this run's, from the first step's start
to the last step's start, the same steps), also with each hang's own ``hang_timeout`` taken out of the
wall time (the user's choice of how long a step may take: reported beside); per fault the seconds
lost (the moment the failed step would have started -> the slowest rank starts it again), split into
detection (-> the failure reached the last rank, from the recovery's log line; relaunched: -> the
new processes started), recovery (-> the training function called again; relaunched: -> the checkpoint
loaded, on the slowest rank) and the first step after (-> the slowest rank's first trained step), and
the steps computed again (the last completed step before the fault - the step the next attempt
started from) and their time; whether the final weights equal the reference's, bit for bit. A
``worker-kill``'s loss is the slowest rank's delay over the next 10 steps. Medians and [min, max]
over the faults of a run (and over ``--reps`` runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "resume_main.py"
KINDS = ("raise", "kill", "hang", "worker-kill", "lose")
MODES = ("none", "inplace", "relaunch")
HANG_TIMEOUT_SEC = 5.0
CHECKPOINT_EVERY = 100
#: Steps after a worker kill over which its delay is measured.
WORKER_WINDOW = 10
#: No fault in the first and the last steps (the recovery must have steps to show).
MARGIN = 20


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    iteration: int
    attempt: int  #: the attempt it fires in

    def spec(self) -> str:
        """Its ``FTH_INJECT`` part."""
        return f"{self.kind}@rank={self.rank},iteration={self.iteration},attempt={self.attempt}"


def draw_schedule(seed: int, steps: int, every_sec: float, step_ms: float, world: int,
                  kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """The faults of a run of ``steps`` steps, one per ``every_sec`` seconds of ``step_ms`` steps:
    fault ``j`` in the middle half of the ``j``-th window, its rank drawn at random and its kind from a
    shuffled deck of every kind (each kind as often as the others, +-1, in every run); each fires
    in the attempt it is reached in (every kind but ``worker-kill`` starts a new attempt)."""
    if steps < 1 or every_sec <= 0 or step_ms <= 0 or world < 1 or not kinds:
        raise ValueError(f"draw_schedule: steps {steps}, every_sec {every_sec}, step_ms {step_ms} and world {world} "
                         f"must be positive, kinds {kinds!r} not empty")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"draw_schedule: unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    rng = random.Random(seed)
    gap = max(4, round(every_sec * 1000 / step_ms))
    faults: list[Fault] = []
    attempt = 0
    deck: list[str] = []  # every kind once, in a shuffled order, then again: each kind as often as the others
    for j in range(steps // gap + 1):
        iteration = max(MARGIN, j * gap + rng.randint(gap // 4, 3 * gap // 4))
        if not deck:
            deck = rng.sample(kinds, len(kinds))
        kind, rank = deck.pop(), rng.randrange(world)
        if iteration > steps - MARGIN or (faults and iteration <= faults[-1].iteration):
            continue
        faults.append(Fault(kind, rank, iteration, attempt))
        attempt += kind != "worker-kill"
    return faults


def inject_env(faults: list[Fault]) -> str:
    """``FTH_INJECT`` for ``faults``."""
    return "; ".join(f.spec() for f in faults)


#: ``[rank R] recovering in place, attempt A (...); watchdogs stopped ..., re-formed D s after the failure reached this rank``
RECOVERED = re.compile(r"\[rank (\d+)\] recovering in place, attempt (\d+) \(.*?re-formed ([\d.]+) s after the failure")
#: ``FTH_INJECT=kill@rank=1,iteration=400,attempt=1: injecting kill``
FIRED = re.compile(r"FTH_INJECT=([a-z-]+)@rank=(\d+),iteration=(\d+)\S*: injecting")


def parse_reformed(log: str) -> dict[int, dict[int, float]]:
    """``{attempt: {rank: seconds from the failure reaching the rank to the re-formed group}}`` from
    the recoveries' log lines."""
    found: dict[int, dict[int, float]] = {}
    for m in RECOVERED.finditer(log):
        found.setdefault(int(m.group(2)), {})[int(m.group(1))] = float(m.group(3))
    return found


def parse_fired(log: str) -> set[tuple[str, int, int]]:
    """``(kind, rank, iteration)`` of every injection that fired."""
    return {(m.group(1), int(m.group(2)), int(m.group(3))) for m in FIRED.finditer(log)}


def read_traces(out: Path, world: int) -> dict[int, list[dict]]:
    """Each rank's trained steps, ``{"attempt", "step", "t"}`` (the step's start), in order."""
    traces = {}
    for rank in range(world):
        path = out / f"batches{rank}.jsonl"
        traces[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return traces


def step_started(traces: dict[int, list[dict]], attempt: int, step: int, ranks=None) -> list[float]:
    """When each rank (of ``ranks``) started ``step`` in ``attempt`` (the ones that did)."""
    return [e["t"] for r, trace in traces.items() if ranks is None or r in ranks for e in trace
            if e["attempt"] == attempt and e["step"] == step]


def median_gap(traces: dict[int, list[dict]]) -> float:
    """The median time between two consecutive steps of one attempt, rank 0."""
    trace = traces.get(0, [])
    gaps = [b["t"] - a["t"] for a, b in zip(trace, trace[1:]) if a["attempt"] == b["attempt"] and b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else float("nan")


def fault_figures(fault: Fault, mode: str, traces: dict[int, list[dict]], attempts: dict[tuple[int, int], dict],
                  reformed: dict[int, dict[int, float]], world: int, gap: float) -> dict:
    """One fault's figures: ``lost`` (s), ``detection``, ``recovery``, ``first_step``, ``recompute``
    (s), ``twice`` (steps computed again); NaN where a figure cannot be read."""
    nan = float("nan")
    before = step_started(traces, fault.attempt, fault.iteration - 1, {fault.rank}) or \
        step_started(traces, fault.attempt, fault.iteration - 1)
    if not before:
        return dict(lost=nan, detection=nan, recovery=nan, first_step=nan, recompute=nan, twice=nan)
    fault_t = max(before) + gap  # the failed step would have started then
    if fault.kind == "worker-kill":
        after = step_started(traces, fault.attempt, fault.iteration + WORKER_WINDOW)
        lost = max(0.0, max(after) - fault_t - WORKER_WINDOW * gap) if after else nan
        return dict(lost=lost, detection=nan, recovery=lost, first_step=nan, recompute=0.0, twice=0)
    nxt = fault.attempt + 1
    infos = [attempts[(nxt, r)] for r in range(world) if (nxt, r) in attempts]
    again = step_started(traces, nxt, fault.iteration)
    lost = max(again) - fault_t if len(again) == world else nan
    if len(infos) < world or any("first_step_at" not in i for i in infos):
        return dict(lost=lost, detection=nan, recovery=nan, first_step=nan, recompute=nan, twice=nan)
    first = max(i["first_step_at"] for i in infos)
    twice = fault.iteration - 1 - attempts[(nxt, 0)]["start_iteration"]
    if mode == "inplace":
        called = {r: attempts[(nxt, r)]["marks"]["imported"] for r in range(world)}
        reached = [called[r] - took for r, took in reformed.get(nxt, {}).items() if r in called]
        reach = max(reached) if reached else nan
        detection, recovery = reach - fault_t, max(called.values()) - reach
        first_step = first - max(called.values())
    else:
        started = min(i["started_at"] for i in infos)
        loaded = max(i["marks"].get("loaded", i["marks"].get("latest_checkpoint", started)) for i in infos)
        detection, recovery, first_step = started - fault_t, loaded - started, first - loaded
    return dict(lost=lost, detection=detection, recovery=recovery, first_step=first_step,
                recompute=(max(again) - first) if len(again) == world else nan, twice=twice)


def read_run(out: Path, mode: str, faults: list[Fault], world: int, steps: int, hang_timeout: float) -> dict:
    """A finished run's figures from its records (``OUTDIR`` of ``resume_main.py``) and its log."""
    log = (out / "log").read_text(errors="replace") if (out / "log").exists() else ""
    traces = read_traces(out, world)
    attempts = {}
    for path in out.glob("attempt*_rank*.json"):
        m = re.fullmatch(r"attempt(\d+)_rank(\d+)\.json", path.name)
        if m and int(m.group(2)) < world:
            attempts[(int(m.group(1)), int(m.group(2)))] = json.loads(path.read_text())
    start = step_started(traces, 0, 1)
    end = [e["t"] for trace in traces.values() for e in trace if e["step"] == steps]
    if not start or not end:
        raise RuntimeError(f"the training did not reach step {steps}; see {out / 'log'}")
    wall = max(end) - min(start)
    gap = median_gap(traces)
    fired = parse_fired(log)
    reformed = parse_reformed(log)
    per_fault = []
    for fault in faults:
        figures = fault_figures(fault, mode, traces, attempts, reformed, world, gap)
        per_fault.append(dict(kind=fault.kind, fired=(fault.kind, fault.rank, fault.iteration) in fired, **figures))
    hangs = sum(1 for f in per_fault if f["kind"] == "hang" and f["fired"])
    return dict(wall=wall, wall_no_hang=wall - hangs * hang_timeout, step_sec=gap, faults=per_fault,
                fired=sum(f["fired"] for f in per_fault), twice=sum(f["twice"] for f in per_fault
                                                                      if not math.isnan(f["twice"])))


def same_weights(a: Path, b: Path) -> tuple[bool, float]:
    """Whether two ``weights.pt`` are equal bit for bit, and their largest difference."""
    import torch

    wa, wb = torch.load(a, map_location="cpu"), torch.load(b, map_location="cpu")
    if wa.keys() != wb.keys():
        return False, float("inf")
    diff = max((float((wa[k].double() - wb[k].double()).abs().max()) for k in wa), default=0.0)
    return all(torch.equal(wa[k], wb[k]) for k in wa), diff


def _kill_by_pid(out: Path) -> None:
    """Every process the run's records name that still runs ``resume_main.py`` (workers, spares,
    their DataLoader workers: each leads its process group)."""
    for path in [*out.glob("attempt*_rank*.json"), *out.glob("process_launched*.json")]:
        try:
            pid = int(json.loads(path.read_text())["pid"])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if SCRIPT.name.encode() not in f.read():
                    continue
            os.killpg(pid, signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            continue


def one_run(framework: str, world: int, mode: str, faults: list[Fault], steps: int, step_ms: float, out: Path,
            hang_timeout: float) -> dict:
    out.mkdir(parents=True)
    faults = faults if mode != "none" else []
    recoveries = sum(f.kind != "worker-kill" for f in faults)
    spares = sum(f.kind == "lose" for f in faults) if mode == "inplace" else 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", STEP_MS=str(step_ms), EPOCHS="1",
               SAMPLES=str(4 * world * steps), EVERY=str(CHECKPOINT_EVERY), KEEP="2", WORKERS="1", HIDDEN="32",
               PG_TIMEOUT_SEC="1800", FTH_HANG_TIMEOUT_SEC=f"{hang_timeout:g}", FTH_INJECT=inject_env(faults),
               INPLACE=str(recoveries + 2) if mode == "inplace" else "", SPARES=str(spares))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world + spares),
           "--max-restarts", str(recoveries + 2 if mode == "relaunch" else 0), str(SCRIPT), framework, str(out)]
    deadline = 4 * steps * step_ms / 1000 + 120 + 60 * len(faults)
    began = time.time()
    with open(out / "log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and what it started in its session
            proc.wait()
            _kill_by_pid(out)  # each worker leads a session of its own
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode} after {time.time() - began:.0f} s; see {out / 'log'}")
    result = read_run(out, mode, faults, world, steps, hang_timeout)
    result.update(load=os.getloadavg()[0], spares=spares)
    return result


#: A finished run's settings and figures, in its directory: ``--keep`` reuses it.
RESULT = "result.json"


def _commit() -> str:
    """The commit the bench ran at (``-`` outside a git checkout)."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "-"
    except (OSError, subprocess.SubprocessError):
        return "-"


def kept_result(out: Path, settings: dict) -> dict | None:
    """The figures of a run that finished in ``out`` with these ``settings`` (so that a long bench can
    be split across calls with the same ``--keep``), or None. A finished run with other settings is an
    error: the report would mix them."""
    path = out / RESULT
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    if kept.get("settings") != settings:
        raise RuntimeError(f"{out} holds a run with other settings ({kept.get('settings')}, not {settings}): "
                           "give another --keep, or remove it")
    return dict(kept["result"], commit=kept.get("commit", "-"))


def summary(values: list[float], fmt: str = ".2f") -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


NAMES = {"none": "no fault (the reference)", "inplace": "recover_in_place, live state",
         "relaunch": "torchrun --max-restarts, latest_checkpoint"}


def report(results: dict, failed: dict, args, schedules: dict) -> str:
    lines = [f"Goodput: {args.minutes:g} min of training per run ({args.step_ms:g} ms steps), faults drawn with seed "
             f"{args.seed}, hang_timeout {args.hang_timeout:g} s (every other timeout at its default), a checkpoint every "
             f"{CHECKPOINT_EVERY} steps; {args.reps} run(s) each; median [min, max] over the faults (and runs). "
             "Lost per fault: the failed step's planned start -> the slowest rank starts it again. Step: the median "
             "time between two steps of one attempt (rank 0); lost to faults: the sum over the run's faults.", "",
             "| framework | ranks | fault every | restart | faults fired / drawn | wall (s) | step (ms) | lost to faults (s) | efficiency | "
             "efficiency, hang_timeout not counted | lost per fault (s) | detection (s) | recovery (s) | "
             "first step after (s) | recomputing (s) | steps computed twice | final weights |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (framework, world, every, mode), runs in sorted(results.items(), key=lambda kv: (
            kv[0][0], kv[0][1], -kv[0][2], MODES.index(kv[0][3]))):
        ref = results.get((framework, world, 0, "none"))
        base = statistics.median(r["wall"] for r in ref) if ref else float("nan")
        faults = [f for r in runs for f in r["faults"]]
        counted = [f for f in faults if f["fired"]]
        eff = [100 * base / r["wall"] for r in runs]
        eff_nh = [100 * base / r["wall_no_hang"] for r in runs]
        exact = [r.get("exact") for r in runs]
        weights = ("reference" if mode == "none" else "equal" if all(e for e in exact) else
                   f"differ (max diff {max(r.get('diff', float('nan')) for r in runs):.1e})")
        cell = (lambda key: summary([f[key] for f in counted])) if counted else (lambda key: "-")
        lines.append(
            f"| {framework} | {world} | {f'{every:g} s' if every else '-'} | {NAMES[mode]} | "
            f"{sum(r['fired'] for r in runs)} / {len(faults)} | {summary([r['wall'] for r in runs], '.1f')} | "
            f"{summary([1000 * r['step_sec'] for r in runs], '.1f')} | "
            f"{summary([sum(f['lost'] for f in r['faults'] if f['fired'] and not math.isnan(f['lost'])) for r in runs], '.1f')} | "
            f"{summary(eff, '.1f')} % | {summary(eff_nh, '.1f')} % | {cell('lost')} | {cell('detection')} | "
            f"{cell('recovery')} | {cell('first_step')} | {cell('recompute')} | "
            f"{sum(r['twice'] for r in runs):g} | {weights} |")
    kinds = sorted({f["kind"] for runs in results.values() for r in runs for f in r["faults"] if f["fired"]},
                   key=KINDS.index)
    if kinds:
        lines += ["", "Seconds lost per fault, by kind (median [min, max] over every run's faults of that kind):", "",
                  "| framework | ranks | restart | " + " | ".join(kinds) + " |",
                  "|---|---:|---|" + "---:|" * len(kinds)]
        by: dict[tuple, dict[str, list[float]]] = {}
        for (framework, world, every, mode), runs in results.items():
            for r in runs:
                for f in r["faults"]:
                    if f["fired"]:
                        by.setdefault((framework, world, mode), {}).setdefault(f["kind"], []).append(f["lost"])
        for (framework, world, mode), lost in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], MODES.index(kv[0][2]))):
            lines.append(f"| {framework} | {world} | {NAMES[mode]} | "
                         + " | ".join(summary(lost.get(k, [])) for k in kinds) + " |")
    lines += ["", "Schedules (kind@rank,iteration; the same for both frameworks and restarts):"]
    for (world, every), faults in sorted(schedules.items()):
        lines.append(f"- {world} ranks, one per {every:g} s: " + (", ".join(
            f"{f.kind}@{f.rank},{f.iteration}" for f in faults) or "none drawn"))
    for key, why in sorted(failed.items()):
        lines.append(f"- FAILED {key[0]} {key[1]} ranks every {key[2]:g} s {key[3]}: {'; '.join(why)}")
    commits = sorted({r.get("commit", "-") for runs in results.values() for r in runs})
    if commits:
        lines.append(f"- run at commit(s) {', '.join(commits)}")
    loads = [r["load"] for runs in results.values() for r in runs]
    if loads:
        lines.append(f"- load average at the end of the runs: {summary(loads, '.1f')} on {os.cpu_count()} CPUs")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Efficiency per framework, world, rate and restart (matplotlib, if installed; else nothing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path})", file=sys.stderr)
        return
    keys = sorted((k for k in results if k[3] != "none"), key=lambda k: (k[0], k[1], -k[2], MODES.index(k[3])))
    values = []
    for key in keys:
        ref = results.get((key[0], key[1], 0, "none"))
        base = statistics.median(r["wall"] for r in ref) if ref else float("nan")
        values.append(statistics.median(100 * base / r["wall"] for r in results[key]))
    fig, ax = plt.subplots(figsize=(max(6, len(keys) * 0.9), 4))
    ax.bar(range(len(keys)), values, color=["tab:green" if k[3] == "inplace" else "tab:gray" for k in keys])
    ax.set_xticks(range(len(keys)), [f"{k[0]} {k[1]}r\n1/{k[2]:g}s\n{k[3]}" for k in keys], fontsize=7)
    ax.set_ylabel("training efficiency (%)")
    ax.set_ylim(0, 105)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10, help="training per run, in minutes at --step-ms (10)")
    parser.add_argument("--step-ms", type=float, default=50, help="each step's length, slept in the step (50)")
    parser.add_argument("--every", type=float, nargs="+", default=[60, 20], help="seconds between faults (60 20)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8], help="world sizes (4 8)")
    parser.add_argument("--frameworks", nargs="+", default=["ignite", "lightning"], help="ignite lightning")
    parser.add_argument("--modes", nargs="+", default=["inplace", "relaunch"], help="with faults: inplace relaunch")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), help=f"fault kinds drawn ({' '.join(KINDS)})")
    parser.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT_SEC, help="FTH_HANG_TIMEOUT_SEC (5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--plot", help="a PNG of the efficiencies (needs matplotlib)")
    parser.add_argument("--keep", metavar="DIR", help="keep every run's records and log under DIR; a run that "
                        "finished there with the same settings is reused, so a long bench can be split across calls")
    args = parser.parse_args(argv)
    for name, values, valid in (("--frameworks", args.frameworks, ("ignite", "lightning")),
                                ("--modes", args.modes, ("inplace", "relaunch")), ("--kinds", args.kinds, KINDS)):
        bad = set(values) - set(valid)
        if bad:
            parser.error(f"{name}: unknown {', '.join(sorted(bad))}; choose from {', '.join(valid)}")
    if args.minutes <= 0 or args.step_ms <= 0 or min(args.every) <= 0 or args.hang_timeout <= 0 or args.reps < 1:
        parser.error("--minutes, --step-ms, --every, --hang-timeout and --reps must be positive")
    if min(args.worlds) < 2:
        parser.error(f"--worlds: every world size must be >= 2; got {args.worlds}")
    steps = round(args.minutes * 60 * 1000 / args.step_ms)
    schedules = {(world, every): draw_schedule(args.seed + world, steps, every, args.step_ms, world, tuple(args.kinds))
                 for world in args.worlds for every in args.every}
    results: dict[tuple, list[dict]] = {}
    failed: dict[tuple, list[str]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="fth-bench-goodput-")))
        for rep in range(args.reps):
            for framework in args.frameworks:
                for world in args.worlds:
                    plan = [(0.0, "none")] + [(every, mode) for every in args.every for mode in args.modes]
                    for every, mode in plan:
                        key = (framework, world, every, mode)
                        out = tmp / f"{framework}-{world}-{every:g}-{mode}-{rep}"
                        faults = schedules.get((world, every), []) if mode != "none" else []
                        settings = dict(minutes=args.minutes, step_ms=args.step_ms, hang_timeout=args.hang_timeout,
                                        seed=args.seed, faults=[f.spec() for f in faults])
                        try:
                            res = kept_result(out, settings) if args.keep else None
                            if res is not None:
                                print(f"{framework} {world} ranks {mode} every {every:g} s run {rep + 1}: "
                                      f"reused from {out}", flush=True)
                            else:
                                shutil.rmtree(out, ignore_errors=True)  # an unfinished run of an earlier call
                                res = one_run(framework, world, mode, faults, steps, args.step_ms, out,
                                              args.hang_timeout)
                                ref = tmp / f"{framework}-{world}-0-none-{rep}" / "weights.pt"
                                if mode != "none" and ref.exists():
                                    res["exact"], res["diff"] = same_weights(ref, out / "weights.pt")
                                res["commit"] = _commit()
                                (out / RESULT).write_text(json.dumps(dict(settings=settings, commit=res["commit"],
                                                                          finished=time.time(), result=res)))
                        except Exception as err:  # noqa: BLE001 - a run that did not finish is a result too
                            failed.setdefault(key, []).append(f"run {rep + 1}: {err}")
                            print(f"{framework} {world} ranks {mode} every {every:g} s run {rep + 1}: FAILED: {err}",
                                  flush=True)
                            continue
                        results.setdefault(key, []).append(res)
                        lost = [f["lost"] for f in res["faults"] if f["fired"]]
                        print(f"{framework} {world} ranks {mode} every {every:g} s run {rep + 1}: wall {res['wall']:.1f} s, "
                              f"{res['fired']}/{len(res['faults'])} faults fired, lost per fault {summary(lost)} s, "
                              f"{res['twice']:g} steps twice, exact {res.get('exact', '-')}", flush=True)
    table = report(results, failed, args, schedules)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
