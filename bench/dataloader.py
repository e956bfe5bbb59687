"""Benchmark of RestartableDataLoader: recovery time per restart, epoch throughput with one kill,
and the random-kill campaign.

    .venv/bin/python bench/dataloader.py                  # start time, recovery, throughput, 300+ kills
    .venv/bin/python bench/dataloader.py --kills 60       # a shorter campaign
    .venv/bin/python bench/dataloader.py --skip-campaign

Prints:
* workers' start time: ``iter()`` to first batch for a fresh loader (2 workers), fork and spawn;
* recovery per restart: SIGKILL of a worker while the main process waits in ``next()`` -> next
  batch (median / p95 over kills), with fork and with spawn restarts; goal: within 2x start time;
* throughput ratio: epoch time without a kill / epoch time with one kill at mid-epoch (goal >= 0.9);
* the campaign: random SIGKILLs at random moments over every dataset/sampler kind (``tests/dl_stress``):
  kills, restarts, samples lost, samples duplicated, epochs out of order, hangs, detection p50
  (kill -> loss seen) and restart p95 (loss seen -> new workers started), recovery p95.
A hang (no progress for 120 s) dumps every thread's stack and exits with status 3.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import dl_stress  # noqa: E402
from dl_stress import MapData, kill_children, pct  # noqa: E402
from fault_tolerant_handlers.dataloader import RestartableDataLoader  # noqa: E402

HANG_SEC = 120


def start_time(method: str, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        loader = DataLoader(MapData(64, 0.002), batch_size=4, num_workers=2, multiprocessing_context=method)
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        out.append(time.perf_counter() - t0)
        del it
        kill_children()
    return out


def recovery(method: str, kills: int) -> tuple[list[float], list[float]]:
    """Kill a worker while the main thread waits in next(); return recovery and restart seconds."""
    loader = RestartableDataLoader(MapData(4000, 0.002), batch_size=4, num_workers=2, max_restarts=kills,
                                   restart_start_method=method)
    try:
        every = 1000 // (kills + 1)  # batches between kills
        for k, _ in enumerate(loader):
            if k % every == every // 2 and k // every < kills:
                os.kill(loader.worker_pids[k % 2], signal.SIGKILL)
    finally:
        kill_children()
    return ([r.recovery_seconds for r in loader.restarts if r.recovery_seconds is not None],
            [r.restart_seconds for r in loader.restarts])


def epoch_seconds(kill: bool, n: int = 2000) -> tuple[float, int]:
    loader = RestartableDataLoader(MapData(n, 0.002), batch_size=4, num_workers=2, shuffle=True,
                                   generator=torch.Generator().manual_seed(0), max_restarts=1)
    batches = n // 4
    try:
        t0 = time.perf_counter()
        for k, _ in enumerate(loader):
            if kill and k == batches // 2:
                os.kill(loader.worker_pids[0], signal.SIGKILL)
        return time.perf_counter() - t0, loader.restart_count
    finally:
        kill_children()


def ms(values: list[float]) -> str:
    return "n/a" if not values else f"median {1000 * statistics.median(values):.1f} ms, p95 {1000 * pct(values, 95):.1f} ms"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=int(os.environ.get("FTH_DL_STRESS_KILLS", "324")),
                    help="total random kills in the campaign, spread over every kind (default 324)")
    ap.add_argument("--skip-campaign", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(HANG_SEC * 5, exit=True)

    fork_start = start_time("fork", args.reps)
    spawn_start = start_time("spawn", 2)
    print(f"workers' start time (same loader: 2 workers, 2 ms per sample, iter() -> first batch): fork {ms(fork_start)}; spawn {ms(spawn_start)}")

    rec_fork, rst_fork = recovery("fork", 10)
    rec_spawn, rst_spawn = recovery("spawn", 2)
    ratio = statistics.median(rec_fork) / statistics.median(fork_start)
    print(f"recovery per restart, fork restarts ({len(rec_fork)} kills): loss seen -> next batch {ms(rec_fork)}; "
          f"detection -> workers started {ms(rst_fork)}")
    print(f"  = {ratio:.2f}x the workers' start time (goal <= 2x)")
    print(f"recovery per restart, spawn restarts ({len(rec_spawn)} kills): {ms(rec_spawn)}")

    clean = [epoch_seconds(False) for _ in range(3)]
    killed = [epoch_seconds(True) for _ in range(3)]
    assert all(c == 0 for _, c in clean) and all(c == 1 for _, c in killed)
    t_clean = statistics.median(t for t, _ in clean)
    t_kill = statistics.median(t for t, _ in killed)
    print(f"epoch throughput with one kill / without: {t_clean / t_kill:.3f} "
          f"(epoch {t_clean:.2f} s without, {t_kill:.2f} s with one kill; 500 batches, 2 workers; goal >= 0.9)")

    if args.skip_campaign:
        return 0
    per_kind = math.ceil(args.kills / len(dl_stress.KINDS))
    total = {"kills": 0, "restarts": 0, "lost": 0, "duplicated": 0, "bad_epochs": 0}
    det, rst, rec = [], [], []
    print(f"campaign: {per_kind} random kills per kind, kinds {dl_stress.KINDS}")
    for i, kind in enumerate(dl_stress.KINDS):
        faulthandler.dump_traceback_later(HANG_SEC, exit=True)  # a hang ends the bench with stacks
        epochs = max(3, per_kind // 5)
        r = dl_stress.campaign(kind, kills=per_kind, epochs=epochs, seed=100 + i)
        faulthandler.cancel_dump_traceback_later()
        bad = 0 if r.order_ok else 1
        print(f"  {kind:20s} kills {r.kills:3d} restarts {r.restarts:3d} lost {r.lost} duplicated {r.duplicated} "
              f"in order {r.order_ok} epochs {r.epochs} wall {r.wall_sec:.1f} s "
              f"detection p50 {pct(r.detection_ms, 50):.1f} ms restart p95 {pct(r.restart_ms, 95):.1f} ms")
        total["kills"] += r.kills
        total["restarts"] += r.restarts
        total["lost"] += r.lost
        total["duplicated"] += r.duplicated
        total["bad_epochs"] += bad
        det += r.detection_ms
        rst += r.restart_ms
        rec += r.recovery_ms
    print(f"campaign total: kills {total['kills']}, restarts {total['restarts']}, lost {total['lost']}, "
          f"duplicated {total['duplicated']}, kinds out of order {total['bad_epochs']}, hangs 0")
    print(f"  detection p50 {pct(det, 50):.1f} ms (p95 {pct(det, 95):.1f}); restart p95 {pct(rst, 95):.1f} ms "
          f"(p50 {pct(rst, 50):.1f}); recovery (loss seen -> next batch) p95 {pct(rec, 95):.1f} ms")
    ok = total["lost"] == total["duplicated"] == total["bad_epochs"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
