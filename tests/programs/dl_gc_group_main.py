"""A RestartableDataLoader forked while a process group waits for the collector in a reference cycle:
``python dl_gc_group_main.py``.

A group object left in a cycle after the group was destroyed (an earlier attempt's DDP or session, a
test's) holds the last reference to a ``ProcessGroupGloo``. A forked worker inherits that garbage; a
collection in the worker (here forced by ``worker_init_fn``, in a real run any allocation's) would run
the group's destructor there, which waits on a condition variable of gloo threads the child does not
have: the worker hangs holding the GIL. Prints one JSON line: the batches, the restarts, the seconds.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from fault_tolerant_handlers.dataloader import RestartableDataLoader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _garbage_with_a_group() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    cycle = {"group": dist.group.WORLD}
    cycle["self"] = cycle
    dist.destroy_process_group()  # the cycle now holds the group's last reference


def main() -> None:
    gc.disable()  # the cycle stays uncollected until the workers are forked
    _garbage_with_a_group()
    data = TensorDataset(torch.arange(32))
    loader = RestartableDataLoader(data, batch_size=4, num_workers=2, max_restarts=2,
                                   worker_init_fn=lambda worker_id: gc.collect())
    start = time.monotonic()
    got = [int(i) for (batch,) in loader for i in batch]
    print(json.dumps({"got": got, "restarts": [r.describe() for r in loader.restarts],
                      "seconds": round(time.monotonic() - start, 2), "pid": os.getpid()}))


if __name__ == "__main__":
    main()
