"""Two CPU ranks (gloo); one fails, and every rank stops together with the real cause.

    python examples/demo.py            # ours, then stock Ignite for comparison
    python examples/demo.py --no-stock # ours only

Scenes:
  1. ``one_rank_first``: rank 0 downloads a dataset first and the download fails. Rank 1 must not
     read the half-made data, and must not wait in a barrier.
  2. ``fail_together``: rank 1 hits a bad sample while rank 0 is still busy in the same section.
  3. (stock) the same as scene 1 with ``ignite.distributed.one_rank_first``, where rank 0 catches
     the error to retry later: rank 1 waits in the barrier until the process-group timeout (5 s
     here; 30 minutes by default) and never learns why.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from fault_tolerant_handlers import PeerFailedError, fail_together, one_rank_first

STOCK_TIMEOUT = timedelta(seconds=5)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, PeerFailedError):
        return f"PeerFailedError: {str(exc).splitlines()[0]}"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:110]}"


def _scene(rank: int, queue, scene: str, body) -> None:
    start = time.time()
    fault_at = [None]
    try:
        body(fault_at)
        what = "finished normally"
    except Exception as exc:  # noqa: BLE001 - the demo reports whatever each rank raised
        what = _describe(exc)
        if isinstance(exc, PeerFailedError) and exc.failed_at:
            fault_at[0] = exc.failed_at
    end = time.time()
    queue.put((scene, rank, what, end - (fault_at[0] or start)))


def _rank_main(rank: int, world: int, port: int, queue, stock: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    # A short timeout so the stock scene ends in seconds; ours never waits for it.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=STOCK_TIMEOUT)

    def download(fault_at):
        with one_rank_first(rank=0, name="download MNIST"):
            if rank == 0:
                time.sleep(0.5)
                fault_at[0] = time.time()
                raise OSError("mirror unreachable: https://example.invalid/mnist.tar.gz")
            print(f"[rank {rank}] reading the dataset (must not happen)", flush=True)

    def train_step(fault_at):
        with fail_together("train step", step=3, epoch=0):
            if rank == 1:
                fault_at[0] = time.time()
                raise ValueError("bad sample 17: image has 0 channels")
            time.sleep(1.0)  # rank 0 is still busy when rank 1 fails; both stop when it is done

    _scene(rank, queue, "1 one_rank_first (ours)", download)
    _scene(rank, queue, "2 fail_together (ours)", train_step)

    if stock:
        import ignite.distributed as idist

        def stock_download(fault_at):
            try:
                with idist.one_rank_first(rank=0):
                    if rank == 0:
                        fault_at[0] = time.time()
                        raise OSError("mirror unreachable: https://example.invalid/mnist.tar.gz")
            except OSError:
                if rank == 0:
                    time.sleep(STOCK_TIMEOUT.total_seconds() + 2)  # rank 0 backs off before a retry
                raise

        _scene(rank, queue, "3 one_rank_first (stock Ignite)", stock_download)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - after the stock scene the gloo pair may be closed
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-stock", action="store_true", help="skip the stock Ignite comparison")
    args = parser.parse_args()
    stock = not args.no_stock
    if stock:
        try:
            import ignite  # noqa: F401
        except ImportError:
            print("pytorch-ignite is not installed: skipping the stock comparison", file=sys.stderr)
            stock = False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    print(f"Starting {world} CPU ranks (gloo)...", flush=True)
    mp.start_processes(_rank_main, args=(world, port, queue, stock), nprocs=world, join=True, start_method="spawn")
    results = []
    while not queue.empty():
        results.append(queue.get())
    for scene in sorted({r[0] for r in results}):
        print(f"\nScene {scene}")
        for _, rank, what, latency in sorted(r for r in results if r[0] == scene):
            print(f"  rank {rank}: {what}")
            print(f"          stopped {latency:.2f} s after the fault")
    print()


if __name__ == "__main__":
    main()
