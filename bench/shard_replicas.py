"""Step time of a 2-rank FSDP2 CPU job without ShardReplicas, with, and with the wait for the copy, side by side in one run.

    python bench/shard_replicas.py                       # small and ~100 MB shards, a few minutes
    python bench/shard_replicas.py --sizes 100 --blocks 8
    python bench/shard_replicas.py --sizes 100 --every 5 --steps 10

Starts 2 gloo ranks (``torch.multiprocessing.spawn``, killed by pid at the end). Per size, a model of
``Linear(w, w)`` layers, each ``fully_shard``-ed, with Adam: each rank's shard (parameters + Adam's two
moments) is about the size asked. The steps alternate in blocks, without / with replication (A B B A
...); a step's time is forward + backward + optimizer step (+ ``ShardReplicas.step``: the copy on the
training thread; the CRC-32 and the sends run on the replicas' threads, and overlap the next steps).
A third kind of block ("wait") also calls ``ShardReplicas.wait_home()`` as each step starts, as the
Ignite adapter does: the step waits until the partner acknowledged the previous step's copy. The
blocks go without / with / wait / wait / with / without ... After each replicating block the pending
send is flushed outside the timing, so that no block overlaps another's send. Printed per size and
kind: median and p10-p90 of the step time, the ratio of medians to "without", the copy's median, the
wait's median, snapshots replaced before they were sent, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _q(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _rank(rank: int, world: int, port: int, sizes: list[float], blocks: int, steps: int, every: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fault_tolerant_handlers.data import replicas as module
    from fault_tolerant_handlers.data.replicas import ShardReplicas

    reused = [0]
    take = module.take_snapshot

    def counted(*args, buffer=None, **kwargs):  # how many copies were made into a buffer used before
        snap = take(*args, buffer=buffer, **kwargs)
        reused[0] += buffer is not None and snap.payload.data_ptr() == buffer.data_ptr()
        return snap

    module.take_snapshot = counted

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    replicas = ShardReplicas([f"node{r}" for r in range(world)], replicate_every=every, timeout=timedelta(seconds=120))
    for mb in sizes:
        # per rank: 3 x params / world floats (params, exp_avg, exp_avg_sq) = mb MB
        width = int((mb * 2**20 / 4 * world / 3) ** 0.5)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
        x = torch.randn(4, width)
        kinds = ("without", "with", "wait")
        times: dict[str, list[float]] = {k: [] for k in kinds}
        copies, waits = [], []
        replaced0, reused0 = replicas.stats.replaced, reused[0]
        step = 0
        for block in range(-1, blocks):  # block -1: warm-up, not counted
            kind = "wait" if block == -1 else kinds[(0, 1, 2, 2, 1, 0)[block % 6]]
            with_replicas = kind != "without"
            replicas.wait = timedelta(seconds=5 if kind == "wait" else 0)
            for _ in range(steps):
                step += 1
                start = time.perf_counter()
                if kind == "wait":
                    replicas.wait_home()  # the previous step's copy acknowledged, as the adapter does
                    waits.append(time.perf_counter() - start)
                model(x).square().mean().backward()
                optim.step()
                optim.zero_grad()
                if with_replicas and step % every == 0:
                    t = time.perf_counter()
                    replicas.step({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, step)
                    copies.append(time.perf_counter() - t)
                elapsed = time.perf_counter() - start
                if block >= 0:
                    times[kind].append(elapsed)
            dist.barrier()
            replicas.flush(timedelta(seconds=120))
            dist.barrier()
        shard_mb = replicas.own().payload.numel() / 2**20
        if rank == 0:
            off = statistics.median(times["without"])
            line = f"every {every}  shard {shard_mb:7.1f} MB/rank  " + "  ".join(
                f"{k}: median {statistics.median(ts) * 1e3:.1f} ms (p10-p90 {_q(ts, .1) * 1e3:.1f}-"
                f"{_q(ts, .9) * 1e3:.1f}, x{statistics.median(ts) / off:.3f}, {len(ts)} steps)"
                for k, ts in times.items()) + (
                f"  copy median {statistics.median(copies) * 1e3:.1f} ms  wait median {statistics.median(waits) * 1e3:.1f} ms"
                f" (p10-p90 {_q(waits, .1) * 1e3:.1f}-{_q(waits, .9) * 1e3:.1f})  late {replicas.stats.late}"
                f"  replaced {replicas.stats.replaced - replaced0}/{len(copies)}  reused buffer "
                f"{reused[0] - reused0}/{len(copies)}  load {os.getloadavg()[0]:.1f}")
            print(line, flush=True)
            out.put(line)
        del model, optim
    replicas.stop()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 100], help="shard MB per rank")
    parser.add_argument("--blocks", type=int, default=12, help="blocks of steps, alternated A B C C B A")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--every", type=int, default=1, help="ShardReplicas(replicate_every=...)")
    args = parser.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args.sizes, args.blocks, args.steps, args.every, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=1800)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join()
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    sys.exit(max(p.exitcode or 0 for p in procs))


if __name__ == "__main__":
    main()
