"""A lost host taken over by spares on simulated hosts: the time from the fault to the failed step
trained again, per phase.

    sudo python bench/multihost_spares.py                                   # every scenario, 3 runs each
    sudo python bench/multihost_spares.py --scenarios kill_host:2 --reps 5  # 3 hosts x 2 ranks only
    sudo python bench/multihost_spares.py --scenarios cut_link:1 --frameworks ignite lightning --reps 5
    sudo python bench/multihost_spares.py --scenarios cut_link:1 --before /tmp/old-checkout  # side by side
    sudo python bench/multihost_spares.py --shard-mb 100 --reps 3    # FSDP2, shard copies vs the checkpoint

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

``--shard-mb MB`` (issue 42's budget): the model sharded instead (``resume_main.py``'s ``FSDP=1``:
FSDP2, Adam, a distributed checkpoint every 10 iterations; ``HIDDEN`` chosen so that each training
rank's shard, parameters and Adam's two moments, is about MB: 3 x 4 B x the 10 x ``HIDDEN``
parameters / the training ranks; at 2 ranks rank 0's is 1.1 x MB and rank 1's 0.9 x, the last layer's
(1, ``HIDDEN``) weight being whole on rank 0), one epoch (50 iterations at 2 training ranks), ``kill_host:1`` by
default; each run is made in turn with each ``--restart``: ``inplace``, each rank's shard copied into
its partner's memory on the other host after every iteration (``FTH_SHARD_REPLICAS=1``: the spare
receives the lost rank's shard), and ``checkpoint``, the same job without the copies (every rank,
the spare too, resumes from the newest checkpoint, read from the disk: docs/sharded.md). Per run,
besides the phases: ``twice``, the steps computed twice (the iterations from the one resumed at to
the one the failure came in, less that one), and ``fault -> failed step``, the fault -> the slowest
training rank's start of the failed iteration trained again (with copies, the first step; from the
checkpoint, after the steps computed twice). Every run is checked as above (the checkpoint's: resumed
from the checkpoint, not live state): the weights are an uninterrupted run's (of the same model, made
once per framework and layout) bit for bit. At 100 MB (about 1-2 s a step here) a run takes 3 minutes
with Ignite, 3-4 with Lightning, and so does each reference run (a 2-core machine at load average 12-16).
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
        "state sent": parts.get("live state sent", parts.get("live shards sent", 0.0)),  # a sharded model: its shards
        "re-formed": reformed,
        "first step": call_to_step,
        "fault -> step": max(firsts) - run.fault_at,
    }


def hidden_for(shard_mb: float, world: int) -> int:
    """``resume_main.py``'s ``HIDDEN`` for a shard of about ``shard_mb`` MB per rank: its model has
    10 x HIDDEN + 1 parameters, each rank a 1/``world`` shard of them and of Adam's two moments (float32)."""
    return max(1, round(shard_mb * 2**20 * world / (3 * 4 * 10)))


def redone(run, per_host: int) -> dict[str, float]:
    """The steps computed twice and the fault -> the failed step trained again (the slowest rank's)."""
    training = range(2 * per_host)
    failed = max(e["step"] for r in training for e in run.trained(r) if e["attempt"] == 0)
    start = run.tries(0)[1]["start_iteration"]
    again = max(failed, start + 1)  # the failure came after the last step every rank began: the next one
    at = max(next(e["t"] for e in run.trained(r) if e["attempt"] == 1 and e["step"] == again) for r in training)
    return {"twice": max(0, failed - 1 - start), "fault -> failed step": at - run.fault_at}


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]" if values else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", help=f"comma-separated FAULT:RANKS_PER_HOST, of {', '.join(SCENARIOS)} "
                                             "(default: all; with --shard-mb, kill_host:1)")
    parser.add_argument("--reps", type=int, default=3, help="runs per scenario (1-50)")
    parser.add_argument("--frameworks", nargs="+", default=["ignite"], choices=["ignite", "lightning"],
                        help="the training of resume_main.py each scenario runs (default: ignite)")
    parser.add_argument("--before", type=Path, help="a checkout whose library each run is also made with, in turn")
    parser.add_argument("--shard-mb", type=float,
                        help="a sharded model (FSDP2, Adam) of about this many MB per training rank (1-2000)")
    parser.add_argument("--restart", nargs="+", choices=["inplace", "checkpoint"],
                        help="with --shard-mb: from shard copies in the partners' memory, from the newest checkpoint "
                             "(each run made with each, in turn; default: both)")
    args = parser.parse_args()
    if args.scenarios is None:
        args.scenarios = "kill_host:1" if args.shard_mb is not None else ",".join(SCENARIOS)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        parser.error(f"--scenarios: {bad} not among {', '.join(SCENARIOS)}")
    if not 1 <= args.reps <= 50:
        parser.error(f"--reps must be from 1 to 50, got {args.reps}")
    if args.before is not None and not (args.before / "fault_tolerant_handlers").is_dir():
        parser.error(f"--before {args.before}: no fault_tolerant_handlers package there")
    if args.shard_mb is not None and not 1 <= args.shard_mb <= 2000:
        parser.error(f"--shard-mb must be from 1 to 2000, got {args.shard_mb:g}")
    if args.shard_mb is not None and args.before is not None:
        parser.error("--shard-mb and --before: one at a time")
    if args.shard_mb is None and args.restart is not None:
        parser.error("--restart needs --shard-mb")
    # side -> (the checkout whose library the ranks import, more of their environment)
    sides = {"": (HERE.parent, {})} if args.before is None else {"before": (args.before.resolve(), {}),
                                                                 "after": (HERE.parent, {})}
    shard = args.shard_mb is not None
    if shard:  # the same job with the shard copies, or without (from the checkpoint)
        sides = {r: (HERE.parent, {"FTH_SHARD_REPLICAS": "1"} if r == "inplace" else {})
                 for r in args.restart or ("inplace", "checkpoint")}
    slow = args.shard_mb or 0  # a larger model's steps: about 1 s each at 100 MB here
    reason = hosts.unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="fth-bench-spares-") as tmp:
        factory = _Factory(Path(tmp))
        for framework, scenario in [(f, s) for f in args.frameworks for s in scenarios]:
            fault, per_host = scenario.split(":")[0], int(scenario.split(":")[1])
            model = {} if not shard else {"FSDP": "1", "HIDDEN": str(hidden_for(args.shard_mb, 2 * per_host)),
                                          "EPOCHS": "1"}
            ref = reference(factory, world=2 * per_host, framework=framework, env=model, deadline=150 + 6 * slow)
            got: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
            failed: dict[str, list[str]] = {side: [] for side in sides}
            for rep, (side, (root, env)) in [(r, s) for r in range(args.reps) for s in sides.items()]:
                hosts.ROOT = root  # the ranks' PYTHONPATH: that checkout's library
                name = f"{framework} {scenario} {side} run {rep + 1}".replace("  ", " ")
                run = run_spares(Path(tmp) / f"{framework}-{fault}-{per_host}-{rep}{side}", fault, per_host=per_host,
                                 framework=framework, env={**model, **env}, after_fault=60 + 3 * slow,
                                 deadline=200 + 6 * slow)
                try:
                    assert_spares_took(run, ref, per_host=per_host, behind=None if shard else 0,
                                       live=side != "checkpoint")
                    measured = phases(run, per_host)
                    if shard:
                        measured.update(redone(run, per_host))
                except (AssertionError, StopIteration) as err:
                    failed[side].append(str(err).splitlines()[0][:200])
                    print(f"{name}: failed: {failed[side][-1]}", flush=True)
                    continue
                for key, value in measured.items():
                    got[side].setdefault(key, []).append(value)
                how = "two witnesses" if "acknowledged nothing sent to it" in run.log("node-a") else "one witness"
                again = shard and re.search(r"\w+ \d+ computed again: [^)]*", run.log("node-a"))  # why, with copies
                how += f"; {again.group(0)}" if again else ""
                print(f"{name}: " + ", ".join(f"{k} {v:.2f}" if k != "twice" else f"{k} {v:.0f}"
                                              for k, v in measured.items()) + f" ({how})", flush=True)
            rows += [(framework, scenario, side, got[side], failed[side]) for side in sides]
    names = ["detection", "agreement", "claim -> seat", "state sent", "re-formed", "first step", "fault -> step"]
    if shard:
        return shard_table(rows, names, args.shard_mb)
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


def shard_table(rows: list, names: list[str], shard_mb: float) -> int:
    """The table of ``--shard-mb``: per restart, the phases, the steps computed twice and the fault ->
    the failed step trained again."""
    print(f"\n| framework | hosts x ranks | fault | shard/rank (MB) | restart | runs ok | "
          + " | ".join(f"{n} (s)" for n in names) + " | steps computed twice | fault -> failed step (s) | over 3 s |")
    print("|---|---|---|---:|---|---:|" + "---:|" * (len(names) + 3))
    for framework, scenario, side, got, failed in rows:
        fault, per_host = scenario.split(":")
        ok = len(got.get("detection", []))
        twice = got.get("twice", [])
        print(f"| {framework} | 3 x {per_host} | {fault} | {shard_mb:g} | {side} | {ok}/{ok + len(failed)} | "
              + " | ".join(cell(got.get(n, [])) for n in names)
              + f" | {'-' if not twice else f'{statistics.median(twice):.0f} [{min(twice):.0f}, {max(twice):.0f}]'}"
              + f" | {cell(got.get('fault -> failed step', []))}"
              + f" | {sum(t > 3 for t in got.get('fault -> failed step', []))} |")
        for why in failed:
            print(f"  failed: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
