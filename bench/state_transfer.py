"""Benchmark: sending live state from rank 0 to rank 1 over gloo (``recover/transfer.transfer``).

    .venv/bin/python bench/state_transfer.py                       # 10, 100, 1000 MB; chunk sweep at 100 MB
    .venv/bin/python bench/state_transfer.py --mb 100 --reps 9 --chunks-mb 32 --sweep-mb

The state is model-like: float32 weights of a transformer's shape mix (an embedding of a quarter of
the state, then per layer a 3d x d, a d x d, a 4d x d and a d x 4d matrix, biases and norms), and the
counters an engine holds.
Each size runs as a job of its own (2 processes, so that each one's peak RSS is that size's), three
times: to a **replaced** rank (it holds nothing: every tensor is allocated as it arrives), the same
with the agreed ``checksum=`` checked by the receiver (one more pass over the bytes), and **in
place** (it holds a zeroed state of the same shapes, written into). Each rep: a barrier, then
``transfer(...)`` timed on the receiver (it returns on both ranks after the last segment and one
small ``all_gather``). ``checksum`` is timed on rank 0 over the same state. Prints medians and [min, max]
and each rank's peak RSS beside what the state alone takes, as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_like(mb: int, fill: bool = True) -> dict:
    """About ``mb`` MB of float32 in a transformer's shape mix (an embedding of a quarter of it, as in
    GPT-2 small, then layers), plus an engine's counters."""
    import torch

    target = mb * 2**20 // 4
    d = 256 if mb <= 16 else 512 if mb <= 128 else 1024
    layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    per_layer = sum(int(torch.Size(s).numel()) for s in layer)
    vocab = max(1, target // 4 // d)
    layers = max(1, (target - vocab * d) // per_layer)
    vocab = max(1, (target - layers * per_layer) // d)
    make = torch.randn if fill else torch.zeros
    weights = {"embed.weight": make(vocab, d)}
    for i in range(layers):
        for j, shape in enumerate(layer):
            weights[f"layers.{i}.p{j}"] = make(*shape)
    return {"model": weights, "engine": {"iteration": 1200, "epoch": 3, "lr": 0.001}}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(out: Path, mb: int, chunk_mb: int, mode: str, reps: int) -> None:
    import torch.distributed as dist

    from fault_tolerant_handlers.recover import live_state, transfer as protocol
    from fault_tolerant_handlers.recover.live_state import LiveReport

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    base = _current_rss_mb()
    state = None
    if rank == 0:
        state = model_like(mb)
    elif mode == "inplace":
        state = model_like(mb, fill=False)
    nbytes = sum(t.numel() * 4 for t in (state or {}).get("model", {}).values())
    result: dict = {"rank": rank, "base_mb": base, "state_mb": nbytes / 2**20}
    if rank == 0:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            protocol.checksum(state)
            times.append(time.perf_counter() - start)
        result["checksum"] = times
    # as a recovery would: each rank reports what it holds (nothing, or a state one step behind), and
    # rank 0's rule plans from whom the other receives
    digest = protocol.checksum(state) if state is not None else ""
    reports = [None, None]
    dist.all_gather_object(reports, LiveReport(rank, -1, "", "replaced") if state is None else
                           LiveReport(rank, 10 - rank, "iteration", "", digest))
    agreed = live_state.plan_live(reports, 2)
    assert (agreed.source, agreed.receivers) == (0, (1,)), agreed.describe()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        # each segment's CRC is checked on receipt; "checked" also the whole state against the agreed checksum
        got = protocol.transfer(state, 0, [1], chunk_bytes=chunk_mb * 2**20,
                                  checksum=agreed.checksum if mode == "checked" else None)
        times.append(time.perf_counter() - start)
        if rank == 1 and mode == "inplace":
            state = got
        del got
    result["transfer"] = times
    result["peak_mb"] = _rss_mb()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def beyond(result: dict, size: float) -> float:
    """Peak RSS less the process's base and the state (the memory the transfer held at its most)."""
    return result["peak_mb"] - result["base_mb"] - size


def summary(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} [{min(values) * 1000:.0f}, {max(values) * 1000:.0f}]"


def run(mb: int, chunk_mb: int, mode: str, reps: int) -> dict[int, dict]:
    from _ranks import run_job  # noqa: PLC0415 - the bench's job launcher

    with tempfile.TemporaryDirectory(prefix="fth-bench-transfer-") as tmp:
        argv = [str(Path(__file__).resolve()), "--worker", tmp, "--mb", str(mb), "--chunk-mb", str(chunk_mb),
                "--mode", mode, "--reps", str(reps)]
        run_job(2, argv, deadline=120 + mb * reps * 0.05, env={"PYTHONPATH": str(ROOT)}, quiet_ranks=False)
        found = {}
        for rank in (0, 1):
            path = Path(tmp) / f"rank{rank}.json"
            if not path.exists():
                raise SystemExit(f"{mb} MB, chunks of {chunk_mb} MB, {mode}: rank {rank} wrote no result")
            found[rank] = json.loads(path.read_text())
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunks-mb", type=int, nargs="*", default=[4, 8, 16, 32, 64],
                        help="chunk sizes of the sweep; the last one with --sweep-mb and none is used for the sizes")
    parser.add_argument("--chunk-mb", type=int, default=None, help="chunk size of the table by size "
                        "(default: transfer.DEFAULT_CHUNK_BYTES)")
    parser.add_argument("--sweep-mb", type=int, nargs="?", const=0, default=100,
                        help="state size of the chunk sweep (0 or no value: no sweep)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="replaced", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mb[0], args.chunk_mb, args.mode, args.reps)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    from fault_tolerant_handlers.recover.transfer import DEFAULT_CHUNK_BYTES

    chunk_mb = args.chunk_mb or DEFAULT_CHUNK_BYTES // 2**20
    print(f"{args.reps} reps each, median [min, max] in ms; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start (a shared machine: times are noisy)")
    if args.sweep_mb:
        print(f"\nChunk size, {args.sweep_mb} MB to a replaced rank:\n")
        print("| chunk | transfer | MB/s (median) | peak RSS beyond base + state: rank 0 / rank 1 |")
        print("|---:|---:|---:|---:|")
        for c in args.chunks_mb:
            res = run(args.sweep_mb, c, "replaced", args.reps)
            t, size = res[1]["transfer"], res[0]["state_mb"]
            print(f"| {c} MB | {summary(t)} | {size / statistics.median(t):.0f} | "
                  f"{beyond(res[0], size):.0f} / {beyond(res[1], size):.0f} MB |", flush=True)
    if not args.mb:
        return
    print(f"\nBy size, chunks of {chunk_mb} MB:\n")
    print("| state | checksum (rank 0) | to a replaced rank | MB/s | the same, checksum= checked | in place | "
          "peak RSS beyond base + state: rank 0 / rank 1 replaced / rank 1 in place |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for mb in args.mb:
        new = run(mb, chunk_mb, "replaced", args.reps)
        checked = run(mb, chunk_mb, "checked", args.reps)
        inplace = run(mb, chunk_mb, "inplace", args.reps)
        size = new[0]["state_mb"]
        med = statistics.median(new[1]["transfer"])
        print(f"| {size:.0f} MB | {summary(new[0]['checksum'])} | {summary(new[1]['transfer'])} | {size / med:.0f} | "
              f"{summary(checked[1]['transfer'])} | {summary(inplace[1]['transfer'])} | "
              f"{beyond(new[0], size):.0f} / {beyond(new[1], size):.0f} / {beyond(inplace[1], size):.0f} MB |",
              flush=True)
    print(f"\nBase: the process before any state (interpreter, torch, gloo: about {new[1]['base_mb']:.0f} MB).")


if __name__ == "__main__":
    main()
