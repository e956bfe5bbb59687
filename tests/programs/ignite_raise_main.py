"""An Ignite training under torchrun whose rank 1 raises ``ValueError`` at iteration 5, uncaught,
with nothing of the library's but ``FaultTolerance().attach(trainer)``.

    torchrun --standalone --nproc-per-node 4 --max-restarts 0 ignite_raise_main.py

``TEARDOWN=<s>``: rank 1 holds an object whose finalizer takes that long when the interpreter tears
its modules down (a slow teardown, as torch's is on a loaded machine): the survivors exit, and
torchrun sends its SIGTERM, while rank 1 is still ending.
"""

import os
import time

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Engine

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


def step(engine, batch):
    if rank == 1 and engine.state.iteration == 5:
        raise ValueError("bad batch at iteration 5")
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


trainer = Engine(step)
FaultTolerance().attach(trainer)
trainer.run(data, max_epochs=2)
