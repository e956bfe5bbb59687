"""20 recoveries in place in one job: what each attempt starts with (run by torchrun, 2 ranks).

``torchrun --standalone --nproc-per-node 2 --max-restarts 0 inplace_lifecycle_main.py OUTDIR``
(``RECOVERIES``, 20 by default, in the environment)

Each attempt is a short Ignite run (DDP, a RestartableDataLoader with 2 workers, FaultTolerance) in
which one rank raises (``FTH_INJECT`` built here: attempt ``a`` fails on rank ``a % 2`` at iteration
``3 + a % 5``); the last attempt trains to the end. Before its process group is made, every attempt
appends to ``OUTDIR/rank<R>.jsonl`` this process's open fds, threads, child processes, resident
memory and the number of keys in torchrun's store. ``OUTDIR/attempt0_rank<R>.json`` holds the pid (for
the harness's ``kill_workers``).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

OUT = Path(sys.argv[1])
RECOVERIES = int(os.environ.get("RECOVERIES", "20"))
os.environ["FTH_INJECT"] = "; ".join(f"raise@rank={a % 2},iteration={3 + a % 5},attempt={a}" for a in range(RECOVERIES))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DistributedSampler, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_tolerant_handlers import RestartableDataLoader, recover_in_place, recovery_attempt  # noqa: E402

RANK = int(os.environ["RANK"])


def children() -> int:
    me, count = str(os.getpid()), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    count += f.read().rsplit(")", 1)[1].split()[1] == me
            except OSError:
                continue
    return count


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def measure(store: dist.TCPStore) -> None:
    row = {"attempt": recovery_attempt(), "fds": len(os.listdir("/proc/self/fd")),
           "threads": len(os.listdir("/proc/self/task")), "children": children(), "rss_kb": rss_kb(),
           "keys": store.num_keys()}
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def train(store: dist.TCPStore) -> int:
    from ignite.engine import Engine
    from torch.nn.parallel import DistributedDataParallel

    from fault_tolerant_handlers.ignite import FaultTolerance

    measure(store)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = RestartableDataLoader(data, batch_size=4, num_workers=2,
                                   sampler=DistributedSampler(data, num_replicas=2, rank=RANK, shuffle=False))

    def step(engine, batch):
        x, y = batch
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    engine = Engine(step)
    FaultTolerance().attach(engine)
    engine.run(loader, max_epochs=1)
    dist.destroy_process_group()
    return recovery_attempt()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"attempt0_rank{RANK}.json").write_text(json.dumps({"pid": os.getpid()}))
    # A client of torchrun's store of its own, to count its keys (the job's groups use their own).
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timedelta(seconds=30))
    final = recover_in_place(train, max_restarts=RECOVERIES)(client)
    measure(client)
    print(f"rank {RANK}: trained to the end in attempt {final}", flush=True)
