"""Cost of live state's bookkeeping on the training thread, per step (one process, CPU).

    python bench/live_overhead.py              # about a minute
    python bench/live_overhead.py --reps 20

While ``recover_in_place`` runs, live state (``fault_tolerant_handlers/data/live.py``) adds per step:
torch's RNG state read as the step starts; the optimizer's step pre/post hooks; at the step's end the
``state_dict()`` of the small objects (Ignite: the engine, the loader; Lightning: the loops' progress
and the loader's position), the optimizers' hyper-parameters and the sum of the model's buffer
versions. Printed:

1. **Per-step cost of the hooks** (microseconds): the adapters' own hooks, as attached to a running
   Ignite ``Engine`` (``ITERATION_STARTED`` + ``ITERATION_COMPLETED``) and a Lightning ``Trainer``
   (``on_train_batch_start`` + ``on_before_optimizer_step`` + ``on_train_batch_end``), called in a
   tight loop from inside the training, plus one optimizer step's pre/post hooks; for a small model
   (``Linear(8, 1)``) and one with 150 layers and 50 BatchNorms (buffers).
2. **Step-time ratio** with/without (Ignite, ``Linear(8, 1)`` on 4-sample batches, a step of a
   fraction of a millisecond: the worst case), runs alternated A B B A ..., median of the per-pair ratios.

Last line: ``live_overhead ignite_us=<x> lightning_us=<y> ratio=<r>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_tolerant_handlers import RestartableDataLoader  # noqa: E402
from fault_tolerant_handlers.core import attempts  # noqa: E402
from fault_tolerant_handlers.data import live  # noqa: E402


def model_of(kind: str) -> torch.nn.Module:
    if kind == "small":
        return torch.nn.Linear(8, 1)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16)]
    for i in range(150):
        layers.append(torch.nn.Linear(16, 16))
        if i % 3 == 0:
            layers.append(torch.nn.BatchNorm1d(16))
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 1))


def data(n: int = 4000) -> RestartableDataLoader:
    x, y = torch.randn(n, 8), torch.randn(n, 1)
    return RestartableDataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)


def ignite_engine(kind: str, with_live: bool, probe=None):
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, DiskSaver

    from fault_tolerant_handlers.ignite import IgniteLive

    torch.manual_seed(0)
    model = model_of(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = data()

    def step(engine, batch):
        x, y = batch
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    engine = Engine(step)
    capture = IgniteLive() if with_live else None
    if capture is not None:
        capture.attach(engine)
    to_save = {"model": model, "optimizer": optimizer, "trainer": engine, "loader": loader}
    engine.add_event_handler(Events.ITERATION_COMPLETED(every=10**9), Checkpoint(to_save, DiskSaver("/tmp/fth-unused",
                                                                                                    require_empty=False)))
    if probe is not None:
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=20), lambda e: probe(e, capture, optimizer))
    return engine, loader


def ignite_hook_us(kind: str, n: int) -> float:
    result = {}

    def probe(engine, capture, optimizer):
        start = time.perf_counter()
        for _ in range(n):
            capture._iteration_started(engine)
            for hook in (live._pre_hook, live._post_hook):
                hook(optimizer, (), {})
            capture._iteration_completed(engine)
        result["us"] = (time.perf_counter() - start) / n * 1e6
        engine.terminate()

    engine, loader = ignite_engine(kind, True, probe)
    engine.run(loader, max_epochs=1)
    live.forget()
    return result["us"]


def lightning_hook_us(kind: str, n: int) -> float:
    import lightning.pytorch as pl

    from fault_tolerant_handlers.lightning import LightningLive

    result = {}

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step != 20:
                return
            capture = LightningLive()
            live_enabled = live.enabled
            live.enabled = lambda: True
            try:
                capture.train_start(trainer)
            finally:
                live.enabled = live_enabled
            capture.why_not = ""  # a single device here: measured as under DDPStrategy
            optimizer = trainer.optimizers[0]
            start = time.perf_counter()
            for _ in range(n):
                capture.step_starts(int(trainer.global_step))
                capture.update_begins()
                live._post_hook(optimizer, (), {})
                capture.batch_end()
            result["us"] = (time.perf_counter() - start) / n * 1e6
            capture.close()
            trainer.should_stop = True

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = model_of(kind)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, callbacks=[Probe()])
        trainer.fit(Module(), data())
    live.forget()
    return result["us"]


def step_time(with_live: bool, steps: int) -> float:
    """Seconds per iteration of a whole run (every handler included), after 20 iterations of warm-up."""
    from ignite.engine import Events

    engine, loader = ignite_engine("small", with_live)
    marks: dict[str, float] = {}
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=20), lambda e: marks.__setitem__("t", time.perf_counter()))
    engine.run(loader, max_epochs=1, epoch_length=steps)
    live.forget()
    return (time.perf_counter() - marks["t"]) / (steps - 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="A/B pairs of the step-time ratio")
    parser.add_argument("--calls", type=int, default=2000, help="hook calls per measure")
    args = parser.parse_args()
    attempts._running_pid = os.getpid()  # as inside recover_in_place: the bookkeeping runs
    torch.set_num_threads(1)
    print("per-step cost of live state's hooks on the training thread (median of 5 measures, us)")
    print("| framework | model | us per step |")
    print("|---|---|---:|")
    worst = {}
    for framework, measure in (("ignite", ignite_hook_us), ("lightning", lightning_hook_us)):
        for kind in ("small", "150 layers, 50 BatchNorms"):
            us = statistics.median(measure("small" if kind == "small" else "big", args.calls) for _ in range(5))
            worst[framework] = max(worst.get(framework, 0.0), us)
            print(f"| {framework} | {kind} | {us:.1f} |")
    ratios, without, with_ = [], [], []
    for i in range(args.reps):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {side: step_time(side, 1000) for side in order}
        without.append(got[False])
        with_.append(got[True])
        ratios.append(got[True] / got[False])
    print(f"\nIgnite, Linear(8, 1), batch 4 , {args.reps} A/B pairs: step "
          f"{statistics.median(without) * 1e3:.3f} ms without, {statistics.median(with_) * 1e3:.3f} ms with; ratio "
          f"median {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"live_overhead ignite_us={worst['ignite']:.1f} lightning_us={worst['lightning']:.1f} "
          f"ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
