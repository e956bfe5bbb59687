"""A lost host taken over by spares on simulated hosts: the time from the fault to the failed step
trained again, per phase.

    sudo python bench/multihost_spares.py                                   # every scenario, 3 runs each
    sudo python bench/multihost_spares.py --scenarios kill_host:2 --reps 5  # 3 hosts x 2 ranks only
    sudo python bench/multihost_spares.py --scenarios cut_link:1 --frameworks ignite lightning --reps 5
    sudo python bench/multihost_spares.py --scenarios cut_link:1 --before /tmp/old-checkout  # side by side

Each run is ``tests/distributed/test_multihost_spares.py``'s: 3 simulated hosts (``tests/hosts.py``),
``--nproc-per-node`` 1 or 2 (the scenario's ``:N``), torchrun per host with ``--max-restarts 0``,
``recover_in_place(max_restarts=2, spares=N)`` around ``resume_main.py``'s seeded Ignite (or Lightning) training
(``multihost_recover_main.py``); node-c's ranks are the spares. Once every training rank is past
iteration 15, node-b is killed whole (``kill_host``), its link cut (``cut_link``) or its first
rank's keeper SIGKILLed (``kill_keeper``: its training child dies with it). Every run is checked as
the test checks it (``assert_spares_took``: the spares took node-b's seats, the weights are an
uninterrupted run's bit for bit); a run that fails the check is counted, not timed.

Per run, on training rank 0 (a survivor on node-a; times from the rig's clock at the fault, one
machine, one clock):

* ``detection``: the fault -> the failure reaching rank 0 (a closed connection and a heartbeat
  stopped for 1.2 s, or a heartbeat silent for ``FTH_HEARTBEAT_TIMEOUT_SEC``, 2 s);
* ``agreement``: -> every rank in the recovery and rank 0's decision, the spares' claims included
  (rank 0's log line: ``agreed``, less ``watchdogs stopped``);
* ``claim -> seat``: the spares' own line (the failure reaching the claiming survivor -> the re-formed
  group), the slowest spare's;
* ``state sent``: the live state sent to the spares (rank 0's ``live state sent`` part);
* ``re-formed``: the failure reaching rank 0 -> its group re-formed (all of the above after detection);
* ``first step``: the training function called again -> its first trained step, the slowest rank's;
* ``fault -> step``: the fault -> the slowest training rank's first trained step.

Medians [min, max] over the runs, and how many took over 3 s. ``--before DIR``: each run is also made
with the library of another checkout (the same rank programs, this one's: only the library differs),
in turn with this one's, so that both see the same load. Needs root (the rig); each run takes 30-60 s.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "distributed")]

import hosts  # noqa: E402
from test_multihost_spares import TOOK, assert_spares_took, reference, run_spares  # noqa: E402

SCENARIOS = ("kill_host:1", "cut_link:1", "kill_keeper:1", "kill_host:2", "cut_link:2")
#: rank 0's recovery line (recover/inplace.py)
RECOVERED = re.compile(r"\[rank 0\] recovering in place, attempt 1 .*?; watchdogs stopped ([0-9.]+) s, agreed ([0-9.]+) s, "
                       r"torn down ([0-9.]+) s \((.*?)\), re-formed ([0-9.]+) s after the failure")


class _Factory:
    """``tmp_path_factory`` for :func:`reference` outside pytest."""

    def __init__(self, root: Path) -> None:
        self.root, self.n = root, 0

    def mktemp(self, name: str) -> Path:
        self.n += 1
        path = self.root / f"{name}{self.n}"
        path.mkdir(parents=True)
        return path


def phases(run, per_host: int) -> dict[str, float]:
    log = run.log("node-a")
    m = RECOVERED.search(log)
    if m is None:
        raise AssertionError("rank 0's recovery line is missing")
    stopped, agreed, reformed = float(m.group(1)), float(m.group(2)), float(m.group(5))
    parts = dict((name.rsplit(" ", 1)[0], float(name.rsplit(" ", 1)[1])) for name in m.group(4).split(", ") if " " in name)
    calls = {r: next(c for c in run.all(r, "attempt") if c["attempt"] == 1) for r in range(per_host)}
    call0 = calls[0]["t"]
    firsts = [run.tries(r)[1]["first_step_at"] for r in range(2 * per_host)]
    call_to_step = max(run.tries(r)[1]["first_step_at"] - c["t"] for r, c in calls.items())
    spare_calls = [next(c for c in run.all(s, "attempt") if c["attempt"] == 1)
                   for s in range(2 * per_host, 3 * per_host)]
    for r, c in zip(range(per_host, 2 * per_host), spare_calls):
        call_to_step = max(call_to_step, run.tries(r)[1]["first_step_at"] - c["t"])
    seat = max(float(t.group(6)) for t in TOOK.finditer(run.log("node-c")))
    return {
        "detection": call0 - run.fault_at - reformed,
        "agreement": agreed - stopped,
        "claim -> seat": seat,
        "state sent": parts.get("live state sent", 0.0),
        "re-formed": reformed,
        "first step": call_to_step,
        "fault -> step": max(firsts) - run.fault_at,
    }


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]" if values else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated FAULT:RANKS_PER_HOST, of {', '.join(SCENARIOS)}")
    parser.add_argument("--reps", type=int, default=3, help="runs per scenario (1-50)")
    parser.add_argument("--frameworks", nargs="+", default=["ignite"], choices=["ignite", "lightning"],
                        help="the training of resume_main.py each scenario runs (default: ignite)")
    parser.add_argument("--before", type=Path, help="a checkout whose library each run is also made with, in turn")
    args = parser.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        parser.error(f"--scenarios: {bad} not among {', '.join(SCENARIOS)}")
    if not 1 <= args.reps <= 50:
        parser.error(f"--reps must be from 1 to 50, got {args.reps}")
    if args.before is not None and not (args.before / "fault_tolerant_handlers").is_dir():
        parser.error(f"--before {args.before}: no fault_tolerant_handlers package there")
    sides = {"": HERE.parent} if args.before is None else {"before": args.before.resolve(), "after": HERE.parent}
    reason = hosts.unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="fth-bench-spares-") as tmp:
        factory = _Factory(Path(tmp))
        for framework, scenario in [(f, s) for f in args.frameworks for s in scenarios]:
            fault, per_host = scenario.split(":")[0], int(scenario.split(":")[1])
            ref = reference(factory, world=2 * per_host, framework=framework)
            got: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
            failed: dict[str, list[str]] = {side: [] for side in sides}
            for rep, (side, root) in [(r, s) for r in range(args.reps) for s in sides.items()]:
                hosts.ROOT = root  # the ranks' PYTHONPATH: that checkout's library
                name = f"{framework} {scenario} {side} run {rep + 1}".replace("  ", " ")
                run = run_spares(Path(tmp) / f"{framework}-{fault}-{per_host}-{rep}{side}", fault, per_host=per_host,
                                 framework=framework)
                try:
                    assert_spares_took(run, ref, per_host=per_host)
                    measured = phases(run, per_host)
                except AssertionError as err:
                    failed[side].append(str(err).splitlines()[0][:200])
                    print(f"{name}: failed: {failed[side][-1]}", flush=True)
                    continue
                for key, value in measured.items():
                    got[side].setdefault(key, []).append(value)
                how = "two witnesses" if "acknowledged nothing sent to it" in run.log("node-a") else "one witness"
                print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in measured.items()) + f" ({how})", flush=True)
            rows += [(framework, scenario, side, got[side], failed[side]) for side in sides]
    names = ["detection", "agreement", "claim -> seat", "state sent", "re-formed", "first step", "fault -> step"]
    print("\n| framework | hosts x ranks | fault | library | runs ok | " + " | ".join(f"{n} (s)" for n in names)
          + " | over 3 s |")
    print("|---|---|---|---|---:|" + "---:|" * (len(names) + 1))
    for framework, scenario, side, got, failed in rows:
        fault, per_host = scenario.split(":")
        ok = len(got.get("detection", []))
        print(f"| {framework} | 3 x {per_host} | {fault} | {side or 'this'} | {ok}/{ok + len(failed)} | "
              + " | ".join(cell(got.get(n, [])) for n in names)
              + f" | {sum(t > 3 for t in got.get('fault -> step', []))} |")
        for why in failed:
            print(f"  failed: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
