"""``hang_timeout="auto"`` measured on real ranks: detection of a hung step, and no false alarm on
long but normal work.

    python bench/autohang.py                 # 5 runs of each case, Ignite and Lightning (about 5 minutes)
    python bench/autohang.py --runs 10 --frameworks ignite

Each run is one of the test suite's rank programs (``tests/ignite_main.py``, ``tests/lightning_main.py``)
on 2 gloo ranks, the rule shortened through its environment (``FTH_AUTO_HANG_FLOOR_SEC=2``,
``FTH_AUTO_HANG_WARMUP=5``; the multiple keeps its default, 10):

* **hang**: rank 1 sleeps forever inside its training step (Ignite: iteration 12; Lightning: global
  step 12, both after an epoch end, so after an evaluation and, for Lightning, a checkpoint). Printed:
  the deadline rank 1 had learned (``max(floor, 10 x its longest step)``), the time from the hang to
  rank 0's ``PeerFailedError`` (target: at most the deadline + 1 s), whether rank 0's error carries
  rank 1's stack and rank 1 ended with exit code 88.
* **slow**: no fault; rank 0 does long but normal work, each piece 1.3 x its learned step deadline of
  the time (a step-based deadline would fire on it): Ignite: an evaluator ``Engine`` run from an
  ``ITERATION_COMPLETED`` handler, a plain evaluation in an ``EPOCH_COMPLETED`` handler, a checkpoint
  written to a slow file; Lightning: a slow first validation batch and a slow checkpoint write
  (``ModelCheckpoint(every_n_train_steps=12)``, inside a step). Printed: false alarms (target: 0).

First it prints the cost of a mark on the training thread (``Guard.beat(step, "step")``, what both
adapters call once per training step), in this process, against the plain beat the adapters made
before: the training thread's CPU time per call, median (min-max) of 15 repeats of 200000 calls.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from launch import PROGRAMS, run_ranks  # noqa: E402

RULE = {"FTH_AUTO_HANG_FLOOR_SEC": "2", "FTH_AUTO_HANG_WARMUP": "5"}
HUNG_LINE = "time.sleep(1000)  # the hung line the report must show"


def _env(framework: str, case: str, step_sleep: float = 0.0) -> tuple[Path, dict, dict]:
    if framework == "ignite":
        env = dict(HANG="auto", USE_FT="1", FTH_TEST_PG_TIMEOUT="30", STEP_SLEEP=str(step_sleep), **RULE)
        env.update(FAULT="hang", FAULT_RANK="1", FAULT_ITER="12") if case == "hang" else env.update(FAULT="none", SLOW="1")
        return PROGRAMS / "ignite_main.py", env, {}
    env = dict(USE_FT="1", OEC="0", LAUNCH="ddp", FTH_TEST_TOP="1", FTH_HANG_TIMEOUT_SEC="auto", **RULE)
    env.update(FAULT="hang", FAULT_RANK="1", FAULT_STEP="12", LINGER="0") if case == "hang" else env.update(
        FAULT="none", SLOW="1")
    return PROGRAMS / "lightning_main.py", env, {"result_ranks": 2}


def run(framework: str, case: str, step_sleep: float = 0.0) -> dict:
    script, env, extra = _env(framework, case, step_sleep)
    with tempfile.TemporaryDirectory(prefix=f"autohang-{framework}-{case}-") as tmp:
        world = 2 if framework == "ignite" else 1
        results = run_ranks(world, "", Path(tmp), script=script, env=env, deadline=90, **extra)
    alarms = sum(r.stderr.count("RankHung") for r in results)
    if case == "slow":
        slow = [e for r in results for e in r.events if e["event"] == "slow"]
        return dict(ok=all(r.returncode == 0 and r.has("run_returned") for r in results) and alarms == 0,
                    alarms=alarms, pieces=[(e["kind"], e["seconds"], e["step_deadline"]) for e in slow])
    fault = results[1].event("fault")
    seen = results[0].event("run_raised")
    found = re.search(r"over the learned deadline of ([0-9.]+) s", seen.get("exc_message", ""))
    exit_code = (results[1].returncode if framework == "ignite"
                 else next((e["returncode"] for e in results[0].events if e["event"] == "child_exited"), None))
    deadline = float(found.group(1)) if found else float("nan")
    latency = seen["t"] - fault["t"]
    stack = HUNG_LINE in seen.get("message", "") + seen.get("remote_traceback", "")
    return dict(ok=bool(found) and latency <= deadline + 1.0 and stack and exit_code == 88, deadline=deadline,
                latency=latency, longest_step=fault["longest"]["step"], stack=stack, exit_code=exit_code)


def mark_cost(calls: int = 200_000, repeats: int = 15) -> list[str]:
    from fault_tolerant_handlers.core.session import Guard
    from fault_tolerant_handlers.detect import watchdog
    from fault_tolerant_handlers.detect.autohang import AutoHangProbe, Unobserved

    class Watchdog:  # what Guard.beat reaches: the real Watchdog.beat, over the fields it sets, and the probe
        beat = watchdog.Watchdog.beat

        def __init__(self, auto) -> None:
            self.auto_hang, self._progress, self.warm, self._first_step = auto, None, False, None
            self.unobserved = Unobserved()

    class Session:
        def __init__(self, watchdog) -> None:
            self.watchdog = watchdog

    def guard(auto: bool) -> Guard:
        g = Guard()
        g.session = Session(Watchdog(AutoHangProbe(0, 1, frame=lambda: None) if auto else None))
        return g

    def per_call(fn) -> list[float]:
        out = []
        for _ in range(repeats):
            t0 = time.thread_time_ns()
            for i in range(calls):
                fn(i)
            out.append((time.thread_time_ns() - t0) / calls / 1e3)
        return out

    off, on = guard(False), guard(True)
    empty = statistics.median(per_call(lambda i: None))
    rows = ["| per training step | us per call (loop overhead subtracted) |", "|---|---:|"]
    for name, fn in (("beat(step): before", lambda i: off.beat(i)),
                     ("beat(step, 'step'): hang_timeout not auto", lambda i: off.beat(i, "step")),
                     ("beat(step, 'step'): hang_timeout='auto'", lambda i: on.beat(i, "step"))):
        rows.append(f"| {name} | {spread([v - empty for v in per_call(fn)], '{:.3f}')} |")
    return rows


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each case (default 5)")
    parser.add_argument("--frameworks", nargs="+", default=["ignite", "lightning"], choices=["ignite", "lightning"])
    parser.add_argument("--step-sleep", type=float, default=0.3,
                        help="also Ignite with every step sleeping this long (a deadline above the floor; 0: skip)")
    parser.add_argument("--only-mark-cost", action="store_true", help="only the cost of a mark (seconds)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    print("\n".join(mark_cost()), flush=True)
    if args.only_mark_cost:
        return
    print(f"hang_timeout='auto', 2 gloo ranks, floor 2 s, warm-up 5 steps, multiple 10; {time.strftime('%Y-%m-%d %H:%M')}")
    rows = ["| framework | hang: detected within deadline + 1 s, with stack, exit 88 | learned deadline (s) "
            "| hang -> every rank raised (s) | latency - deadline (s) | longest step (ms) "
            "| slow work: runs without alarm | pieces over the step deadline |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    cases = [(f, 0.0) for f in args.frameworks] + ([("ignite", args.step_sleep)] if args.step_sleep else [])
    for framework, step_sleep in cases:
        label = framework + (f", {step_sleep:g} s steps" if step_sleep else "")
        hangs = [run(framework, "hang", step_sleep) for _ in range(args.runs)]
        slows = [run(framework, "slow", step_sleep) for _ in range(args.runs)]
        for i, h in enumerate(hangs):
            print(f"  {label} hang {i}: {h}", flush=True)
        for i, s in enumerate(slows):
            print(f"  {label} slow {i}: {s}", flush=True)
        over = sum(1 for s in slows for _, seconds, deadline in s["pieces"] if deadline and seconds > deadline)
        total = sum(len(s["pieces"]) for s in slows)
        rows.append(
            f"| {label} | {sum(h['ok'] for h in hangs)}/{len(hangs)} | {spread([h['deadline'] for h in hangs])} "
            f"| {spread([h['latency'] for h in hangs])} | {spread([h['latency'] - h['deadline'] for h in hangs])} "
            f"| {spread([1000 * h['longest_step'] for h in hangs])} | {sum(s['ok'] for s in slows)}/{len(slows)} "
            f"| {over}/{total} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
