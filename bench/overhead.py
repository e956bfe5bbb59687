"""Step-time cost of the handlers: 2-rank gloo DDP training with and without ``FaultTolerance``.

    python bench/overhead.py            # full run
    python bench/overhead.py --quick    # under a minute

Both ranks build the same model once, then run short trainings alternately without and with the
handler (A B, B A, A B, ...), so machine drift and warm-up hit both alike. Each run is a fresh Ignite ``Engine`` (and
a fresh Lightning ``Trainer``) on the same model and data; its step time is the median of its
iteration times. Printed: the median step time of each side and their ratio, for a small MLP whose
step takes a few milliseconds and a larger one whose step takes tens. The last line is
``overhead_ratio ignite=<x> lightning=<y>`` (the larger of the two models' ratios per framework).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_job  # noqa: E402

MODELS = {"small": (64, 256, 2), "large": (512, 1536, 2)}  # in_features, hidden, layers
#: Iterations per run relative to ``--iters`` (the large model's step is ~10x longer).
ITER_SCALE = {"small": 1.0, "large": 0.25}


def _model(kind: str):
    import torch
    from torch import nn

    d, h, n = MODELS[kind]
    layers = [nn.Linear(d, h), nn.ReLU()]
    for _ in range(n - 1):
        layers += [nn.Linear(h, h), nn.ReLU()]
    torch.manual_seed(0)
    return nn.Sequential(*layers, nn.Linear(h, 1))


def _data(kind: str, iters: int, batch: int = 64):
    import torch

    d = MODELS[kind][0]
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, d, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(iters)]


def ignite_run(model, optimizer, data, with_ft: bool) -> float:
    import torch
    from ignite.engine import Engine, Events

    times: list[float] = []

    def step(engine, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    engine = Engine(step)
    last = [0.0]
    engine.add_event_handler(Events.ITERATION_STARTED, lambda e: last.__setitem__(0, time.perf_counter()))
    if with_ft:
        from fault_tolerant_handlers.ignite import FaultTolerance

        FaultTolerance().attach(engine)
    # measured last, so the handler's own work on ITERATION_COMPLETED is inside the step time
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: times.append(time.perf_counter() - last[0]))
    engine.run(data, max_epochs=1)
    return statistics.median(times[2:])


def lightning_run(kind: str, data, with_ft: bool) -> float:
    import lightning.pytorch as pl
    import torch

    times: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.t)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model(kind)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callbacks: list = []
    if with_ft:
        from fault_tolerant_handlers.lightning import FaultTolerance

        callbacks.append(FaultTolerance())
    callbacks.append(Timer())  # after ours: our batch-end work is inside the step time
    trainer = pl.Trainer(accelerator="cpu", devices=torch.distributed.get_world_size(), num_nodes=1, strategy="ddp",
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, use_distributed_sampler=False)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer.fit(Module(), loader)
    return statistics.median(times[2:])


def rank_main(outdir: Path, pairs: int, iters: int, frameworks: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    results: dict = {}
    for kind in MODELS:
        data = _data(kind, max(20, int(iters * ITER_SCALE[kind])))
        if "ignite" in frameworks:
            model = DDP(_model(kind))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            a, b = [], []
            for i in range(pairs):  # A B, then B A: neither side always runs first
                for with_ft in ((False, True) if i % 2 == 0 else (True, False)):
                    (b if with_ft else a).append(ignite_run(model, optimizer, data, with_ft))
            results[f"ignite/{kind}"] = (a, b)
        if "lightning" in frameworks:
            a, b = [], []
            for i in range(pairs):
                for with_ft in ((False, True) if i % 2 == 0 else (True, False)):
                    (b if with_ft else a).append(lightning_run(kind, data, with_ft))
            results[f"lightning/{kind}"] = (a, b)
    if rank == 0:
        (outdir / "result.json").write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)  # every rank has its numbers: skip teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer pairs and iterations (under a minute)")
    parser.add_argument("--pairs", type=int, default=None, help="A/B pairs per model (default 10; --quick 4)")
    parser.add_argument("--iters", type=int, default=None, help="iterations per run of the small model (default 300; --quick 80)")
    parser.add_argument("--frameworks", nargs="+", default=["ignite", "lightning"], choices=["ignite", "lightning"])
    parser.add_argument("--rank-main", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    pairs = args.pairs or (4 if args.quick else 10)
    iters = args.iters or (80 if args.quick else 300)
    if args.rank_main:
        rank_main(args.rank_main, pairs, iters, args.frameworks)
        return
    outdir = Path(tempfile.mkdtemp(prefix="overhead-"))
    run_job(2, [__file__, "--rank-main", str(outdir), "--pairs", str(pairs), "--iters", str(iters),
                "--frameworks", *args.frameworks], deadline=1800, env={"PYTHONWARNINGS": "ignore"}, quiet_ranks=False)
    results = json.loads((outdir / "result.json").read_text())
    print(f"step-time overhead, 2 gloo ranks on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, "
          f"{pairs} A/B pairs x {iters} iterations, default settings")
    print("| framework/model | without (ms) | with (ms) | ratio |")
    print("|---|---:|---:|---:|")
    worst: dict[str, float] = {}
    for key, (a, b) in results.items():
        ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        ratio = statistics.median(y / x for x, y in zip(a, b))
        worst[key.split("/")[0]] = max(worst.get(key.split("/")[0], 0.0), ratio)
        print(f"| {key} | {ma:.2f} | {mb:.2f} | {ratio:.3f} |")
    print("overhead_ratio " + " ".join(f"{k}={v:.3f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
