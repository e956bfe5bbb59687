"""No false alarm, counted: healthy 8-rank trainings with the library on busy cores, many times.

    python bench/soak.py                          # Ignite and Lightning, 10 runs each, 2 CPU hogs
    python bench/soak.py --runs 3 --frameworks ignite --hogs 4 --world 8

Each run is ``tests/soak_main.py`` (Ignite under ``torchrun --standalone``, Lightning ``ddp`` with
CPU devices), 2 epochs of 30 iterations, no fault, beside ``--hogs`` processes that each keep a core
busy (this machine has 2). A run passes when every rank finished every iteration, the job exited 0
and the library declared nothing (no rank lost, silent or hung, no store lost, no ended job). Prints
one line per run, then per framework the pass count and the median and range of the run times; with
``--verbose`` the declarations of a failed run. Exit code 1 when a run failed.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--hogs", type=int, default=2, help="processes that each keep a core busy")
    parser.add_argument("--frameworks", nargs="+", choices=("ignite", "lightning"), default=["ignite", "lightning"])
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds per run before it is killed")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.runs < 1 or args.world < 2 or args.hogs < 0:
        parser.error("--runs must be >= 1, --world >= 2, --hogs >= 0")
    failed = 0
    summary = []
    with tempfile.TemporaryDirectory(prefix="fth-soak-") as tmp:
        for framework in args.frameworks:
            times, passed = [], 0
            for i in range(args.runs):
                with cpu_hogs(args.hogs):
                    run = healthy_run(framework, args.world, Path(tmp) / f"{framework}-{i}", deadline=args.deadline)
                ok = run.clean(args.world, ITERATIONS)
                passed += ok
                times.append(run.seconds)
                finished = sum(r.get("finished") == ITERATIONS for r in run.ranks.values())
                print(f"{framework} run {i + 1}/{args.runs}: {'pass' if ok else 'FAIL'} rc={run.returncode} "
                      f"ranks finished {finished}/{args.world} declarations {len(run.declarations)} "
                      f"{run.seconds:.1f} s", flush=True)
                if not ok and args.verbose:
                    print("\n".join(run.declarations[:20]) or run.output[-3000:], flush=True)
            failed += args.runs - passed
            summary.append(f"{framework}: {passed}/{args.runs} passed at {args.world} ranks beside {args.hogs} CPU hogs; "
                           f"run time median {statistics.median(times):.1f} s [{min(times):.1f}-{max(times):.1f}]")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
