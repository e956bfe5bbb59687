"""Cross-host fault detection, stock torch vs. the library: the multi-host matrix.

    sudo python bench/multihost.py                       # 2 hosts x 1 rank, Ignite, every fault once
    sudo python bench/multihost.py --hosts 4 --nproc 2   # 4 hosts (a bridge) x 2 ranks
    sudo python bench/multihost.py --faults cut_link --repeat 3 --json out.json

Each run starts a real job on simulated hosts (``tests/hosts.py``: network namespaces with their own
hostname and pid namespace, torchrun with c10d rendezvous per host), injects one fault at host
``--fault-host`` (host faults from outside once every rank trains; ``raise`` by ``FTH_INJECT`` on
that host's first rank), and records what every rank reported. Stock runs are stock Ignite
(or Lightning) with the same program; library runs attach ``FaultTolerance()`` with its defaults.
Both use a 60 s process-group timeout (stock gloo's default is 30 minutes). A run ends when every
rank and agent has ended or ``--after-fault`` seconds after the fault; then everything is killed.

Per rank it prints: seconds from the fault to the rank's report (``run`` raised, or the watchdog's
reported exit) and to its process's end, what it reported (the peer it names, ``own error`` when it
raised a backend error as its own, ``-`` when it reported nothing), and whether its process ended
without an outside kill (``killed``: its host was the one killed; ``deadline``: the rig killed it).
Then the exact exception text each rank saw. With ``--repeat`` the times are medians [min-max].
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import hosts  # noqa: E402

DEFAULT_FAULTS = ("raise", "kill_host", "cut_link", "drop_packets")
_OWN_FAILURE = r"\[rank {rank}( step \d+)?\] failed: "
_EXIT_REPORT = re.compile(r"ending this process with exit code (\d+): (.*)")


def summarize(res: hosts.MultiHostResult, mode: str) -> list[dict]:
    rows = []
    for r in res.ranks:
        host = res.host_of(r.rank)
        log = res.log(host.index)
        raised = r.raised
        exit_report = r.event("watchdog_exit")
        reported_at = None
        if raised is not None:
            reported_at = raised["t"]
        elif exit_report is not None:
            reported_at = exit_report["t"]
        own = bool(re.search(_OWN_FAILURE.format(rank=r.rank), log))
        fault_here = (res.fault in hosts.RANK_FAULTS and r.rank == res.fault_rank) or (
            res.fault in hosts.HOST_FAULTS and host.index == res.fault_host)
        if raised is not None and raised["raised"] == "PeerFailedError":
            what = f"names rank {raised['failed_rank']}" + (f" ({raised['host']})" if raised.get("host") else "")
            text = raised["message"].splitlines()[0]
        elif exit_report is not None:
            m = _EXIT_REPORT.search(exit_report["message"])
            what = "watchdog exit: " + (m.group(2)[:60] if m else "?")
            text = exit_report["message"]
        elif raised is not None:
            injected_here = res.fault in hosts.RANK_FAULTS and r.rank == res.fault_rank
            what = "own fault" if injected_here else "own error" + (" (recorded as its failure)" if own else "")
            text = f"{raised['raised']}: {raised['message']}".splitlines()[0]
        else:
            what, text = "-", ""
        if res.fault == "kill_host" and host.index == res.fault_host:
            ended = "killed"
        elif res.fault == "kill" and r.rank == res.fault_rank:
            ended = "killed"
        elif r.ended_by_itself:
            ended = "yes"
        else:
            ended = "deadline"
        cause = raised.get("cause") if raised else None
        rows.append(dict(
            mode=mode, fault=res.fault, rank=r.rank, host=r.host or host.name,
            fault_here=fault_here,
            report_s=None if reported_at is None or res.fault_at is None else reported_at - res.fault_at,
            end_s=None if r.ended_at is None or res.fault_at is None else r.ended_at - res.fault_at,
            what=what, ended=ended,
            agent=("killed" if ended == "killed" and res.fault == "kill_host" else "yes" if host.ended_at else "deadline"),
            text=text[:400], cause=(cause or "")[:400],
        ))
    return rows


def _fmt(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    if len(values) == 1:
        return f"{got[0]:.2f}"
    missing = len(values) - len(got)
    spread = f" [{min(got):.2f}-{max(got):.2f}]" if len(got) > 1 else ""
    return f"{statistics.median(got):.2f}{spread}" + (f" ({missing} none)" if missing else "")


def _mode(values: list[str]) -> str:
    (value, n), = Counter(values).most_common(1)
    return value if n == len(values) else f"{value} ({n}/{len(values)})"


def table(rows: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["fault"], row["mode"], row["rank"]), []).append(row)
    out = ["| fault | mode | rank (host) | report (s) | process end (s) | reported | ended without outside kill | agent ended |",
           "|---|---|---|---:|---:|---|---|---|"]
    for (fault, mode, rank), rs in groups.items():
        host = rs[0]["host"] + (", faulty" if rs[0]["fault_here"] else "")
        out.append(f"| {fault} | {mode} | {rank} ({host}) | {_fmt([r['report_s'] for r in rs])} | "
                   f"{_fmt([r['end_s'] for r in rs])} | {_mode([r['what'] for r in rs])} | "
                   f"{_mode([r['ended'] for r in rs])} | {_mode([r['agent'] for r in rs])} |")
    return "\n".join(out)


def texts(rows: list[dict]) -> str:
    seen, out = set(), []
    for row in rows:
        key = (row["fault"], row["mode"], row["rank"], row["text"], row["cause"])
        if key in seen or not row["text"]:
            continue
        seen.add(key)
        out.append(f"{row['fault']} / {row['mode']} / rank {row['rank']}: {row['text']}")
        if row["cause"]:
            out.append(f"    caused by: {row['cause']}")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="ranks per host")
    p.add_argument("--faults", nargs="+", default=list(DEFAULT_FAULTS), choices=hosts.HOST_FAULTS + hosts.RANK_FAULTS)
    p.add_argument("--modes", nargs="+", default=["stock", "library"], choices=["stock", "library"])
    p.add_argument("--framework", default="ignite", choices=["ignite", "lightning"])
    p.add_argument("--fault-host", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--after-fault", type=float, default=75.0,
                   help="seconds after the fault before everything is killed (default 75: past the 60 s timeout)")
    p.add_argument("--json", type=Path, help="also write every run's rows here")
    p.add_argument("--keep", type=Path, help="keep every run's records and host logs under this directory")
    args = p.parse_args(argv)
    reason = hosts.unavailable()
    if reason:
        sys.exit(f"bench/multihost.py: {reason}")
    if not 0 <= args.fault_host < args.hosts:
        p.error(f"--fault-host must be in [0, {args.hosts - 1}]")
    rows: list[dict] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="fth-multihost-") as tmp:
        if args.keep:
            tmp = str(args.keep)
        for rep in range(args.repeat):
            for fault in args.faults:
                for mode in args.modes:
                    t0 = time.time()
                    res = hosts.run_hosts(Path(tmp) / f"rep{rep}", fault, hosts=args.hosts,
                                          nproc_per_node=args.nproc, fault_host=args.fault_host,
                                          use_ft=mode == "library", framework=args.framework,
                                          after_fault=args.after_fault, env={"LINGER": "10"})
                    if res.fault_at is None:
                        print(f"# {fault}/{mode}: the fault never fired\n{res.describe()}", file=sys.stderr)
                        continue
                    got = summarize(res, mode)
                    rows.extend(got)
                    print(f"# {fault}/{mode} rep {rep}: {time.time() - t0:.0f} s; "
                          + "; ".join(f"rank {r['rank']}: {r['what']} at {r['report_s']}" for r in got),
                          file=sys.stderr, flush=True)
    print(f"## {args.hosts} hosts x {args.nproc} ranks, {args.framework}, fault at host {args.fault_host}, "
          f"{args.repeat} run(s) each, {time.time() - started:.0f} s in all\n")
    print(table(rows))
    print("\n## What each rank saw\n")
    print(texts(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
