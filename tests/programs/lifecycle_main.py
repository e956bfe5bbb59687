"""One rank of the lifecycle test: ``python lifecycle_main.py <outdir>`` (started by ``launch.run_ranks``).

Creates a fail-together session with its watchdog (threads, the liveness helper process, store
connections), runs an agreement, then stops and closes it, ``ROUNDS`` times in one process, and
records after each round what the process holds: threads, open fds, child processes, exit hooks,
the SIGTERM/SIGINT handlers, the store's key count and whether any of the closed run's keys remain.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from fault_tolerant_handlers import fail_together
from fault_tolerant_handlers.core import procfs
from fault_tolerant_handlers.core.schema import KEY_COUNT, declared_key, heartbeat_key, left_key, record_key, section_key
from fault_tolerant_handlers.core.session import _registry, get_session

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
ROUNDS = int(os.environ.get("ROUNDS", "20"))
OUT = Path(sys.argv[1])


def record(event: str, **fields) -> None:
    fields.update(event=event, rank=RANK, t=time.time())
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")


def children() -> list[int]:
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = procfs.stat_fields(int(entry))
            if fields is not None and int(fields[procfs.PPID]) == me:
                found.append(int(entry))
    return found


def held(store, run_keys: list[str]) -> dict:
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "fds": len(os.listdir("/proc/self/fd")),
        "children": len(children()),
        "atexit": atexit._ncallbacks(),
        "handlers": [repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)],
        "wakeup_fd": signal.set_wakeup_fd(signal.set_wakeup_fd(-1)),
        "store_keys": store.num_keys(),
        "run_keys_left": [k for k in run_keys if store.check([k])],
    }


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FTH_TEST_PG_TIMEOUT", "20"))))
    # A client of the store's own (the default store is prefixed; the session's keys are not).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=10), wait_for_workers=False)
    for round_ in range(ROUNDS):
        session = get_session()
        session.start_watchdog()
        helper = session.watchdog.liveness.pid
        with fail_together("step"):
            pass
        time.sleep(0.6)  # a heartbeat or two from the helper, a few watchdog polls
        prefix = f"fth/{session.run_id}/"
        run_keys = [prefix + k for k in (KEY_COUNT, record_key(1), *(heartbeat_key(r) for r in range(WORLD)),
                                         *(section_key(r) for r in range(WORLD)), *(left_key(r) for r in range(WORLD)),
                                         *(declared_key(r) for r in range(WORLD)))]
        beats = [k for k in run_keys if "/hb/" in k and store.check([k])]
        session.stop_watchdog()
        dist.barrier()  # no rank reads the run's keys any more
        session.abandon(shared_keys=session.table.group_rank == 0)
        assert session.side is None and session not in _registry.values()
        del session
        gc.collect()
        dist.barrier()  # every rank closed (each deletes its own keys, rank 0 the shared ones): then none is left
        record("round", round=round_, helper=helper, heartbeats=beats, **held(store, run_keys))
    dist.barrier()
    record("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
