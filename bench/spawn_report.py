"""How often every surviving rank of a launched job names the cause in its own output.

    PYTHONPATH=. python bench/spawn_report.py --runs 20
    PYTHONPATH=. python bench/spawn_report.py --runs 5 --launchers parallel --faults kill0 hang
    PYTHONPATH=. python bench/spawn_report.py --runs 20 --launchers lightning_ddp torchrun

``idist.Parallel`` (Ignite) and Lightning ``ddp_spawn`` SIGTERM every other rank as soon as one
process exits; Lightning ``ddp`` SIGKILLs every rank within 5 s of a child's failed exit; torchrun
SIGTERMs the other workers within its monitor interval (0.1 s). Each run is a real 2-rank gloo DDP
training (``tests/ignite_main.py`` under ``idist.Parallel`` and torchrun, ``tests/lightning_main.py``
under ``ddp_spawn`` and ``ddp``) with one fault: rank 0 or rank 1 SIGKILLed mid-step, rank 1 raising in
its step, or rank 1 hung (hang deadline 3 s). A run counts as "cause named" when the survivor's own
stdout/stderr names the failing rank and its fault (pid and ``killed by SIGKILL``; the exception with
the remote traceback; ``RankHung`` with the hung line), and "parent leads" when the launcher's final
error does (torch's parent error, and for a SIGKILL whether it names the rank's pid and the
signal, not only ``process 1 terminated with signal SIGKILL``; torchrun's Root Cause; none for Lightning ``ddp``, whose launcher
is rank 0 itself: ``tests/spawn_cases.py``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from spawn_cases import FAULTS, LAUNCHERS, cause_named, missing, parent_names_cause, parent_names_kill, run_case  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="runs per launcher and fault (default 20)")
    p.add_argument("--launchers", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS))
    p.add_argument("--faults", nargs="+", choices=list(FAULTS), default=list(FAULTS))
    p.add_argument("--verbose", action="store_true", help="print what a survivor's output lacks")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs {args.runs}: expected at least 1")
    cases = [(launcher, fault) for launcher in args.launchers for fault in args.faults]
    named = {c: 0 for c in cases}
    parent = {c: 0 for c in cases}
    kill = {c: 0 for c in cases}
    seconds: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    # Round-robin (one run of every case per round), so that an interrupted bench still has
    # comparable counts for every case: each round prints the counts so far.
    for i in range(args.runs):
        for case in cases:
            launcher, fault = case
            start = time.monotonic()
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    run = run_case(launcher, fault, Path(tmp))
                except AssertionError as err:  # a rank still running at the deadline
                    print(f"{launcher} {fault} run {i + 1}: {str(err).splitlines()[0]}", flush=True)
                    continue
            ok = cause_named(run)
            named[case] += ok
            led = parent_names_cause(run)
            parent[case] = None if led is None else parent[case] + led
            full = parent_names_kill(run)
            kill[case] = None if full is None else kill[case] + full
            seconds[case].append(time.monotonic() - start)
            if args.verbose and not ok:
                for r in run.survivors:
                    out = run.outputs.get(r, "")
                    said = [line for line in out.splitlines() if " lost" in line or "PeerFailedError" in line][-8:]
                    print(f"{launcher} {fault} run {i + 1}: rank {r} lacks {missing(run, r)}; what it said:\n"
                          + "\n".join(said) + f"\n--- its output's tail:\n{out[-3000:]}", flush=True)
            if args.verbose and (led is False or full is False):
                print(f"{launcher} {fault} run {i + 1}: the launcher's output:\n{run.parent[-2500:]}", flush=True)
        print(f"after {i + 1} runs each: " + ", ".join(f"{l} {f} {named[(l, f)]}/{i + 1}" for l, f in cases),
              flush=True)
    print("\n| launcher | fault | cause named (survivor's own output) | launcher's final error leads to it "
          "| it names the killed rank's pid and signal | median s a run (spread) |")
    print("|---|---|---:|---:|---:|---:|")
    for case in cases:
        spent = sorted(seconds[case])
        median = spent[len(spent) // 2] if spent else float("nan")
        spread = f"{spent[0]:.0f}-{spent[-1]:.0f}" if spent else "-"
        led = "-" if parent[case] is None else f"{parent[case]}/{args.runs}"
        full = "-" if kill[case] is None else f"{kill[case]}/{args.runs}"
        print(f"| {case[0]} | {case[1]} | {named[case]}/{args.runs} | {led} | {full} "
              f"| {median:.0f} ({spread}) |")

if __name__ == "__main__":
    main()
