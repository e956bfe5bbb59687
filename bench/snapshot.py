"""Benchmark: what keeping the newest checkpoint in memory costs, beside writing and reading it.

    .venv/bin/python bench/snapshot.py                  # 10 MB, 100 MB and 1000 MB of weights, 5 runs each
    .venv/bin/python bench/snapshot.py --mb 100 --reps 9

A checkpoint like Ignite's (a model's state_dict, an SGD optimizer's momentum of the same size, the
engine's state) is kept by ``data/snapshots.keep`` (what ``SafeDiskSaver`` and the Lightning callback
do while ``recover_in_place`` runs), written by ``torch.save`` to a file in a temporary directory
(the page cache: the fastest storage there is, so the ratio is a floor of what shared storage would
give) and read back by ``load_checkpoint`` (from memory) and ``torch.load`` (from the file). Prints
medians and [min, max] in one table, and the memory the copy holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_tolerant_handlers.core import attempts  # noqa: E402
from fault_tolerant_handlers.data import snapshots  # noqa: E402


def checkpoint(mb: int) -> dict:
    n = mb * 1024 * 1024 // 4 // 2
    model = {"layer.weight": torch.randn(n)}
    return {"model": model, "optimizer": {"state": {0: {"momentum_buffer": torch.randn(n)}},
                                          "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0]}]},
            "trainer": {"iteration": 30, "epoch": 1}}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} [{min(values) * 1000:.1f}, {max(values) * 1000:.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    attempts._running_pid = os.getpid()  # as inside recover_in_place
    print(f"{args.reps} runs each, median [min, max] in ms; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| checkpoint | keep in memory (copy) | torch.save to a file | load_checkpoint from memory | "
          "torch.load from the file (page cache) | memory held |")
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="fth-bench-snapshot-") as tmp:
        path = Path(tmp) / "checkpoint_30.pt"
        for mb in args.mb:
            ckpt = checkpoint(mb)
            keep, save, from_memory, from_file = [], [], [], []
            for _ in range(args.reps):
                keep.append(timed(lambda: snapshots.keep(path, ckpt)))
                save.append(timed(lambda: torch.save(ckpt, path)))
                from_memory.append(timed(lambda: snapshots.load_checkpoint(path)))
                snapshots.forget()
                from_file.append(timed(lambda: snapshots.load_checkpoint(path, weights_only=True)))
            print(f"| {mb} MB | {summary(keep)} | {summary(save)} | {summary(from_memory)} | {summary(from_file)} | "
                  f"{snapshots.last_cost[1] / 2**20:.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
