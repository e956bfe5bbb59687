"""A RestartableDataLoader whose first worker never reaches Python: ``python dl_worker_start_main.py stuck|busy``.

CPython 3.11.7 can hang a forked child inside ``os.fork()``, before its first Python line (gh-112275: the
child blocks on the thread-list lock in ``PyOS_AfterFork_Child``). An ``os.register_at_fork(after_in_child=...)``
hook runs at that same place, so here the first fork after the reference passes (the first worker of the
first pass) ``stuck``: sleeps forever in ``select`` (asleep, no CPU time, as the futex wait is), or ``busy``:
spins 3 s there (CPU time: slow, not stuck). Every other fork is left alone.

Two passes (``persistent_workers=False``: each forks its workers) run once without the hook armed (the
reference), then with it, on a loader built the same way. Prints one JSON line: both runs' batches, the
restarts, and whether the worker declared stuck is still a process. ``FTH_WORKER_START_SEC`` sets the deadline.
"""

from __future__ import annotations

import json
import logging
import os
import select
import sys
import time

import torch
from torch.utils.data import Dataset

from fault_tolerant_handlers.dataloader import RestartableDataLoader

logging.basicConfig(level=logging.WARNING)
MODE = sys.argv[1]
assert MODE in ("stuck", "busy"), MODE
armed, forks = [False], [0]


def _before() -> None:
    if armed[0]:
        forks[0] += 1


def _in_child() -> None:
    if not (armed[0] and forks[0] == 1):
        return
    if MODE == "stuck":
        select.select([], [], [])  # never returns: asleep, no CPU
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        pass


os.register_at_fork(before=_before, after_in_child=_in_child)


class Samples(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        time.sleep(0.002)
        return i


def passes() -> tuple[list, RestartableDataLoader]:
    loader = RestartableDataLoader(Samples(), batch_size=4, shuffle=True, num_workers=2,
                                   generator=torch.Generator().manual_seed(7))
    return [[b.tolist() for b in loader] for _ in range(2)], loader


reference, _ = passes()
armed[0] = True
t0 = time.monotonic()
got, loader = passes()
print(json.dumps({
    "reference": reference, "got": got, "seconds": time.monotonic() - t0, "forks": forks[0],
    "restarts": [{"worker_id": r.worker_id, "worker_pid": r.worker_pid, "reason": r.reason, "signal": r.signal,
                  "epoch": r.epoch, "batch_index": r.batch_index} for r in loader.restarts],
    "pid_left": [r.worker_pid for r in loader.restarts if os.path.exists(f"/proc/{r.worker_pid}")],
}), flush=True)
