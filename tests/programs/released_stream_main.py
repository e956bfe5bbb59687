"""One rank of 'no event loop of a released group spins': ``python released_stream_main.py <outdir>``.

``ROUNDS`` rounds of 3 ranks all-reducing a 16 MB tensor again and again. In round ``r``, rank
``r % 3`` cuts its connections in the middle of an all-reduce, as a failing rank's release does
(:func:`interrupts.cut_connections`); the others see their operation fail and cut theirs, as their
watchdogs' releases do. Then every rank destroys the group, quiets the released connections as a
recovery's teardown does (``QUIET=0``: not), and forms the next round's group. The destroyed groups
are held, as in a real job something holds them (3-6 of them per rank in an 8-rank Ignite run).

After the last round each rank idles 3 s and records the CPU its process used meanwhile (``idle``).

The groups' timeout is 5 s: about one round in six, a rank whose all-reduce was sending a chunk of the
16 MB tensor when its connection was cut stays blocked in gloo's ``UnboundBuffer::waitSend`` until
the group's timeout (the send queued on the socket is not failed when the pair closes, and the pair's
socket is already closed, so a second cut finds nothing to cut). That is gloo's, not what is tested
here (the event loops afterwards); with 30 s, four such rounds overran the test's bound in CI.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fault_tolerant_handlers.core import interrupts

ROUNDS = int(os.environ.get("ROUNDS", "6"))
QUIET = os.environ.get("QUIET", "1") == "1"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timedelta(seconds=60))
    keep = interrupts.store_ports(store)

    def everyone(key: str) -> None:
        store.add(key, 1)
        while int(store.add(key, 0)) < world:
            time.sleep(0.01)

    rng = random.Random(rank)
    tensor = torch.ones(4 << 20)
    held, quieted, took = [], 0, []
    for r in range(ROUNDS):
        began = time.monotonic()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round{r}/", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=5))
        held.append(dist.group.WORLD)
        dist.all_reduce(torch.ones(1))
        if rank == r % world:
            threading.Timer(rng.uniform(0.05, 0.3), interrupts.cut_connections, (keep,)).start()
        try:
            while True:
                dist.all_reduce(tensor)
        except RuntimeError:
            pass
        interrupts.cut_connections(keep)
        everyone(f"failed{r}")
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass
        if QUIET:
            quieted += interrupts.quiet_released()
        everyone(f"destroyed{r}")
        took.append(round(time.monotonic() - began, 2))
    time.sleep(1.0)
    start, wall = cpu_seconds(), time.monotonic()
    time.sleep(3.0)
    with open(out / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"event": "idle", "rank": rank, "cpu": (cpu_seconds() - start) / (time.monotonic() - wall),
                            "quieted": quieted, "groups_held": len(held), "rounds": took}) + "\n")
    everyone("done")
    if rank == 0:
        time.sleep(1.0)  # the store's host goes last


if __name__ == "__main__":
    main()
