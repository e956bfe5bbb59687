"""A training under torchrun whose rank 1 raises ``ValueError`` at iteration 5, uncaught, with
nothing of the library's but ``FaultTolerance().attach(trainer)`` (Ignite) or ``start_watchdog()``
and a ``fail_together`` section per iteration (``plain``: a loop of one's own).

    torchrun --standalone --nproc-per-node 4 --max-restarts 0 root_cause_main.py ignite|plain [OUTDIR]

``TEARDOWN=<s>``: rank 1 holds an object whose finalizer takes that long when the interpreter tears
its modules down (a slow teardown, as torch's is on a loaded machine): the survivors exit, and
torchrun sends its SIGTERM, while rank 1 is still ending.
"""

import os
import sys
import time

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Engine

from fault_tolerant_handlers import fail_together, start_watchdog
from fault_tolerant_handlers.ignite import FaultTolerance


class SlowTeardown:
    def __del__(self, sleep=time.sleep, seconds=float(os.environ.get("TEARDOWN", "0"))):
        sleep(seconds)


dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:
    teardown = SlowTeardown()
torch.manual_seed(0)
model = idist.auto_model(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(20)]


def train(iteration, batch):
    if rank == 1 and iteration == 5:
        raise ValueError(f"bad batch at iteration {iteration}")
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


if sys.argv[1] == "plain":
    start_watchdog()
    for iteration, batch in enumerate(data * 2, 1):
        with fail_together("train", step=iteration):
            train(iteration, batch)
else:
    trainer = Engine(lambda engine, batch: train(engine.state.iteration, batch))
    FaultTolerance().attach(trainer)
    trainer.run(data, max_epochs=2)
