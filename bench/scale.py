"""The library as the world grows: healthy jobs at 2, 4, 8 and 16 ranks, stock and with the library, side by side.

    python bench/scale.py                                   # 2 4 8 16 ranks, Ignite and Lightning, 3 runs each
    python bench/scale.py --worlds 8 --reps 5 --hogs 2      # the issue's start-up target: 8 ranks, median of 5
    python bench/scale.py --worlds 8 16 --hang-timeout 5 --inplace 2 --hogs 2   # no false alarm, in place

Each run is ``tests/soak_main.py`` (Ignite under ``torchrun --standalone``, Lightning ``ddp`` on CPU
devices; 2 epochs of 30 iterations, a 60 s process-group timeout), no fault, beside ``--hogs``
processes that each keep a core busy. Per world size and framework the stock job (no import of the
library) and the job with the library (``FaultTolerance``, and with ``--inplace`` wrapped in
``recover_in_place``) run alternately, so that machine drift hits both alike. Per cell:

* **start**: seconds from the launch to the slowest rank's first trained iteration, median [min-max];
* **finished**: runs in which every rank finished every iteration (stock and library);
* **declarations**: lines in which the library declared a rank lost, silent or hung, or ended a job
  (any is a false alarm here);
* **heartbeat near misses**: the library's warnings that a live rank's heartbeat stood still for
  half of ``FTH_HEARTBEAT_TIMEOUT_SEC`` (the margin left before a false alarm: none means every
  heartbeat was seen within half the limit);
* **lag**: the most any rank finished an iteration after the first rank that finished it, worst run;
* **conns**: TCP connections to the c10d store per rank held by the library (its rank's and its
  helper processes', minus the stock job's), read near the end of training: median over ranks and
  runs, and the most any rank held (a call that overran leaves its socket to its blocked worker
  while a new one connects);
* **cpu**: the library's threads and helper processes' CPU per rank, as a fraction of one core,
  from the first iteration to near the end (``SOAK_STEP_SLEEP`` of 0.05 s per step gives a steady
  phase of 3 s).

Exit code 1 when a library run did not finish or declared anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from launch import cpu_hogs, healthy_run  # noqa: E402 - the tests' harness: one runner for both

ITERATIONS = 60


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--frameworks", nargs="+", choices=("ignite", "lightning"), default=["ignite", "lightning"])
    parser.add_argument("--hogs", type=int, default=0, help="processes that each keep a core busy")
    parser.add_argument("--hang-timeout", type=float, default=None, help="the handler's hang_timeout (seconds)")
    parser.add_argument("--inplace", type=int, default=None, help="wrap the run in recover_in_place(max_restarts=N)")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds each step sleeps")
    parser.add_argument("--no-stock", action="store_true", help="the library's runs only")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds per run before it is killed")
    args = parser.parse_args()
    if args.reps < 1 or min(args.worlds) < 2 or args.hogs < 0:
        parser.error("--reps must be >= 1, --worlds >= 2, --hogs >= 0")
    base = {"SOAK_STEP_SLEEP": str(args.step_sleep)}
    library = dict(base, SOAK_LIBRARY="1")
    if args.hang_timeout is not None:
        library["SOAK_HANG_TIMEOUT"] = str(args.hang_timeout)
    if args.inplace is not None:
        library["SOAK_INPLACE"] = str(args.inplace)
    modes = [("library", library)] if args.no_stock else [("stock", dict(base, SOAK_LIBRARY="0")), ("library", library)]
    print(f"# {args.reps} runs per cell, {args.hogs} CPU hogs, library settings: "
          f"hang_timeout={args.hang_timeout} inplace={args.inplace}", flush=True)
    rows, bad = [], 0
    with tempfile.TemporaryDirectory(prefix="fth-scale-") as tmp:
        for world in args.worlds:
            for framework in args.frameworks:
                runs = {mode: [] for mode, _ in modes}
                for i in range(args.reps):
                    for mode, env in (modes if i % 2 == 0 else modes[::-1]):
                        with cpu_hogs(args.hogs):
                            run = healthy_run(framework, world, Path(tmp) / f"{framework}-{world}-{mode}-{i}",
                                              deadline=args.deadline, env=env)
                        runs[mode].append(run)
                        print(f"{framework} {world} ranks {mode} run {i + 1}: finished {run.finished(ITERATIONS)}/{world} "
                              f"start {run.first_step if run.first_step is not None else float('nan'):.1f} s "
                              f"declarations {len(run.declarations)} near misses {len(run.near_misses)} "
                              f"rc={run.returncode}", flush=True)
                        for line in run.near_misses[:3]:
                            print("  " + line.strip()[:300], flush=True)
                        if mode == "library" and (run.finished(ITERATIONS) != world or run.declarations):
                            bad += 1
                            print("\n".join(run.declarations[:10]) or run.output[-2000:], flush=True)
                rows.append((world, framework, runs))
    print()
    print("| ranks | framework | start, stock (s) | start, library (s) | finished stock / library | declarations "
          "| heartbeat near misses | lag, worst (s) | conns per rank | cpu per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world, framework, runs in rows:
        lib, stock = runs["library"], runs.get("stock", [])
        starts = lambda rs: [r.first_step for r in rs if r.first_step is not None]  # noqa: E731
        lags = [r.max_lag for r in lib if r.max_lag is not None]
        # per rank: the stock job's own connections differ by rank (Lightning's rank 0 hosts the store)
        stock_conns = {rank: statistics.median(vals) for rank in range(world)
                       if (vals := [r.ranks[rank]["store_conns"] for r in stock
                                    if "store_conns" in r.ranks.get(rank, {})])}
        conns = [r.ranks[rank]["store_conns"] - stock_conns.get(rank, 0) for r in lib for rank in r.ranks
                 if "store_conns" in r.ranks[rank]]
        cpu = [c for r in lib for c in r.per_rank("lib_cpu")]
        done = lambda rs: sum(r.finished(ITERATIONS) == world for r in rs)  # noqa: E731
        print(f"| {world} | {framework} | {spread(starts(stock))} | {spread(starts(lib))} | "
              f"{done(stock) if stock else '-'}/{len(stock)} / {done(lib)}/{len(lib)} | "
              f"{sum(len(r.declarations) for r in lib)} | {sum(len(r.near_misses) for r in lib)} | {max(lags) if lags else float('nan'):.2f} | "
              f"{f'{statistics.median(conns):g} (max {max(conns):g})' if conns else '-'} | {(100 * statistics.median(cpu)) if cpu else float('nan'):.2f} % |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
