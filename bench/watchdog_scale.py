"""Watchdog control-plane cost and detection latency at 2, 4, 8 and 16 ranks on this machine.

    python bench/watchdog_scale.py                 # 2 4 8 16 ranks
    python bench/watchdog_scale.py --ranks 2 4     # a subset

Every rank starts the watchdog (default interval 0.1 s), then every rank but the last blocks in a
data-group all_reduce that the last rank never joins. The last rank idles ``--idle`` seconds (the
watchdogs' store operations per second are counted meanwhile), then publishes a failure *without*
cutting its own connections, so the blocked ranks can only be woken by their watchdogs. Reported:
store operations per rank per second (median over ranks), and the time from the failure until each
blocked rank's all_reduce raised (median and max over ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_job  # noqa: E402


def rank_main(outdir: Path, idle: float) -> None:
    import torch
    import torch.distributed as dist

    from fault_tolerant_handlers.core.session import Guard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    guard = Guard(sync_every=None, release_on_failure=False)
    guard.start()
    dist.barrier()
    wd = guard.session.watchdog
    ops0, t0 = wd.store_ops, time.monotonic()
    result: dict = {"rank": rank}
    if rank == world - 1:
        time.sleep(idle)
        result["ops_per_sec"] = (wd.store_ops - ops0) / (time.monotonic() - t0)
        result["t_fail"] = time.time()
        guard.on_exception(ValueError("injected"), step=0, epoch=0)
        time.sleep(5)  # stay alive: the others must not be woken by this process's exit
    else:
        try:
            dist.all_reduce(torch.ones(1))
        except Exception:  # noqa: BLE001 - released by the watchdog
            result["t_raised"] = time.time()
        result["ops_per_sec"] = (wd.store_ops - ops0) / (time.monotonic() - t0)
        result["detected"] = wd.peer_error is not None
        wd.acknowledge()
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def run(world: int, idle: float) -> dict:
    outdir = Path(tempfile.mkdtemp(prefix=f"wd{world}-"))
    run_job(world, [__file__, "--rank-main", str(outdir), "--idle", str(idle)], deadline=120 + 4 * world)
    results = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world)
               if (outdir / f"rank{r}.json").exists()]
    t_fail = next(r["t_fail"] for r in results if "t_fail" in r)
    latencies = [r["t_raised"] - t_fail for r in results if "t_raised" in r]
    return {
        "ranks": world,
        "reported": len(results),
        "released": len(latencies),
        "latency_median_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
        "ops_per_rank_per_s": statistics.median(r["ops_per_sec"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle watching before the failure")
    parser.add_argument("--rank-main", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.rank_main, args.idle)
        return
    print(f"watchdog scale on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, gloo, same host")
    print("| ranks | blocked ranks released | detection median (s) | detection max (s) | store ops / rank / s |")
    print("|---:|---:|---:|---:|---:|")
    for world in args.ranks:
        row = run(world, args.idle)
        print(f"| {row['ranks']} | {row['released']}/{row['ranks'] - 1} | {row['latency_median_s']:.3f} | "
              f"{row['latency_max_s']:.3f} | {row['ops_per_rank_per_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
