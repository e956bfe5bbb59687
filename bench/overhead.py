"""Cost of the handlers on 2-8 gloo DDP ranks: three figures, side by side.

    python bench/overhead.py            # full run (about 10 minutes on 2 cores)
    python bench/overhead.py --quick    # about 2 minutes

1. **Step-time ratio** (A/B): both ranks build the same model once, then run short trainings
   alternately without and with the handler (A B, B A, A B, ...), so machine drift and warm-up hit
   both alike. Each run is a fresh Ignite ``Engine`` (and a fresh Lightning ``Trainer``) on the same
   model and data; its step time is the median of its iteration times. Printed per model: the
   median step time of each side, the median of the per-pair ratios and their min-max. This ratio
   moves with whatever else the machine runs.
2. **Background CPU** of the library per rank, as a fraction of one core: CPU time (``utime +
   stime`` of ``/proc/self/task/<tid>/stat``, and the nanosecond ``schedstat``) of every thread
   whose name starts with ``fth-`` and of every child process whose ``comm`` starts with ``fth``,
   divided by the wall time of an Ignite training with ``FaultTolerance`` at 2, 4 and 8 ranks. CPU
   time is what the library takes from the training whoever else shares the machine. Then (2b) the
   same training fed by a DataLoader with ``--loader-workers`` persistent workers at
   ``--loader-worlds`` ranks: torch's own ``DataLoader`` and ``RestartableDataLoader`` alternately
   in the same ranks, each side's step time (batch fetch included) beside the library's CPU with
   it, and the share of our loader's thread (``fth-dataloader-pump``).
3. **Per-step cost on the training thread**: the adapters' per-iteration hooks (Ignite
   ``ITERATION_STARTED``/``ITERATION_COMPLETED`` handlers as attached to a real ``Engine``, the
   Lightning callback's ``on_train_batch_start``/``_end`` with the real ``Trainer``), called in a
   tight loop from inside a running training, plus one agreement (a one-int gloo all_reduce on the
   side group, 2 ranks) divided by ``sync_every``.

The last line is ``overhead_ratio ignite=<x> lightning=<y> cpu_per_rank=<fraction>
cpu_per_rank_loader=<fraction> hook_us=<us>``: the larger of the two models' ratios per framework,
the largest per-rank background CPU over the world sizes without and with our loader, and the
larger of the two adapters' per-step cost.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_job  # noqa: E402

#: Threads the library starts are named ``fth-...``; a helper process would have ``comm`` ``fth...``.
LIBRARY_PREFIX = "fth"
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

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


# -- /proc: the library's own CPU time ---------------------------------------------------------------
def stat_cpu_seconds(stat: str) -> float:
    """``utime + stime`` of a ``/proc/.../stat`` line, in seconds (the name may hold spaces and ``)``)."""
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5)


def schedstat_seconds(schedstat: str) -> float:
    """Time on CPU from a ``/proc/.../schedstat`` line (nanoseconds, first field), in seconds."""
    return int(schedstat.split()[0]) / 1e9


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def library_tasks(proc: str = "/proc") -> dict[str, str]:
    """``{label: /proc directory}`` of this process's library threads and helper processes.

    A thread is the library's when its Python name starts with ``fth-`` (its ``native_id`` is the
    tid) or when its kernel ``comm`` starts with ``fth``; a child process when its ``comm`` does.
    """
    me = os.getpid()
    found: dict[str, str] = {}
    for thread in threading.enumerate():
        if thread.name.startswith(LIBRARY_PREFIX + "-") and thread.native_id is not None:
            found[f"{thread.name}/{thread.native_id}"] = f"{proc}/{me}/task/{thread.native_id}"
    children: set[int] = set()
    for tid in os.listdir(f"{proc}/{me}/task"):
        task = f"{proc}/{me}/task/{tid}"
        comm = (_read(f"{task}/comm") or "").strip()
        if comm.startswith(LIBRARY_PREFIX) and task not in found.values():
            found[f"{comm}/{tid}"] = task
        children.update(int(c) for c in (_read(f"{task}/children") or "").split())
    for pid in sorted(children):
        comm = (_read(f"{proc}/{pid}/comm") or "").strip()
        if comm.startswith(LIBRARY_PREFIX):
            found[f"{comm}/pid {pid}"] = f"{proc}/{pid}"
    return found


def cpu_of(tasks: dict[str, str]) -> dict[str, tuple[float, float | None]]:
    """``{label: (stat seconds, schedstat seconds or None)}`` for the tasks still alive."""
    out = {}
    for label, path in tasks.items():
        stat = _read(f"{path}/stat")
        if stat is None:
            continue
        sched = _read(f"{path}/schedstat")
        out[label] = (stat_cpu_seconds(stat), schedstat_seconds(sched) if sched else None)
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, tuple[float, float | None]]:
    """CPU each task used between two :func:`cpu_of` samples (a task new in ``after`` counts whole)."""
    out = {}
    for label, (stat, sched) in after.items():
        stat0, sched0 = before.get(label, (0.0, 0.0))
        out[label] = (stat - stat0, None if sched is None or sched0 is None else sched - sched0)
    return out


def process_cpu_seconds(proc: str = "/proc") -> float:
    return stat_cpu_seconds(_read(f"{proc}/self/stat") or "")


def _windows_and_total(runs: list[list]) -> tuple[list[dict], dict]:
    """Per-window figures and the totals over several runs' samples (each run's own first to last)."""
    windows = []
    wall = process = store_ops = steps = 0.0
    threads: dict[str, list] = {}
    for samples in runs:
        for (t0, c0, p0, s0, i0), (t1, c1, p1, s1, i1) in zip(samples, samples[1:]):
            d = cpu_delta(c0, c1)
            w = t1 - t0
            windows.append({
                "wall": w,
                "stat": sum(v[0] for v in d.values()) / w,
                "sched": (sum(v[1] for v in d.values()) / w) if all(v[1] is not None for v in d.values()) else None,
                "process": (p1 - p0) / w,
                "store_ops_per_s": (s1 - s0) / w,
                "steps_per_s": (i1 - i0) / w,
            })
        (t0, c0, p0, s0, i0), (t1, c1, p1, s1, i1) = samples[0], samples[-1]
        wall += t1 - t0
        process += p1 - p0
        store_ops += s1 - s0
        steps += i1 - i0
        for label, (stat, sched) in cpu_delta(c0, c1).items():
            acc = threads.setdefault(label, [0.0, 0.0])
            acc[0] += stat
            acc[1] = None if sched is None or acc[1] is None else acc[1] + sched
    total = {
        "wall": wall,
        "threads": {k: [v[0] / wall, None if v[1] is None else v[1] / wall] for k, v in threads.items()},
        "stat": sum(v[0] for v in threads.values()) / wall,
        "sched": (sum(v[1] for v in threads.values()) / wall) if all(v[1] is not None for v in threads.values()) else None,
        "process": process / wall,
        "store_ops_per_s": store_ops / wall,
        "steps_per_s": steps / wall,
        "windows": windows,
    }
    return windows, total


def cpu_rank_main(outdir: Path, seconds: float, loader_workers: int = 0) -> None:
    """One rank: an Ignite training with ``FaultTolerance`` for ``seconds``; the library's CPU over it.

    With ``loader_workers``, the batches come from a DataLoader with that many workers (persistent):
    torch's own ``DataLoader`` and a ``RestartableDataLoader`` alternately (torch, ours, ours, torch),
    each run ``seconds / 2`` long, a fresh ``Engine`` with ``FaultTolerance`` each time. The
    library's CPU is measured over our loader's runs (its pump thread is one of the library's
    threads) and, for comparison, over torch's; the step time (from one iteration's end to the next:
    fetching the batch included) of each side is the median of its iterations."""
    import torch
    import torch.distributed as dist
    from ignite.engine import Engine, Events
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fault_tolerant_handlers.ignite import FaultTolerance

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    model = DDP(_model("small"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = _data("small", 50)

    def step(engine, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    # the ranks agree on one iteration count lasting about `seconds` (DDP keeps them in step)
    start = time.perf_counter()
    for batch in data[:20]:
        step(None, batch)
    per_step = torch.tensor([(time.perf_counter() - start) / 20], dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)

    def train(source, iters: int, **run_kwargs) -> tuple[list, list[float]]:
        """``(samples of the library's CPU, step times)`` of one fresh Engine with FaultTolerance."""
        engine = Engine(step)
        ft = FaultTolerance().attach(engine)
        samples: list = []
        every = max(5, iters // 10)

        def sample(engine) -> None:  # attached after the handler: the watchdog is running
            samples.append((time.monotonic(), cpu_of(library_tasks()), process_cpu_seconds(),
                            _session(ft.guard).watchdog.store_ops, engine.state.iteration))

        ends: list[float] = []
        engine.add_event_handler(Events.ITERATION_COMPLETED(every=every), sample)
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: ends.append(time.perf_counter()))
        engine.run(source, **run_kwargs)
        gaps = [b - a for a, b in zip(ends, ends[1:])]
        return samples, gaps[2:]

    result: dict = {"rank": rank}
    if loader_workers:
        from fault_tolerant_handlers import RestartableDataLoader

        x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
        dataset = torch.utils.data.TensorDataset(x, y)
        kwargs = dict(batch_size=64, num_workers=loader_workers, persistent_workers=True)
        loaders = {"torch": torch.utils.data.DataLoader(dataset, **kwargs),
                   "restartable": RestartableDataLoader(dataset, **kwargs)}
        # the loader's batches cost more than in-memory ones: about half of `seconds` per run
        epochs = max(1, round(seconds / 2 / (2 * per_step.item()) / len(data)))
        runs: dict[str, list] = {"torch": [], "restartable": []}
        steps: dict[str, list] = {"torch": [], "restartable": []}
        for side in ("torch", "restartable", "restartable", "torch"):
            samples, gaps = train(loaders[side], epochs * len(loaders[side]), max_epochs=epochs)
            runs[side].append(samples)
            steps[side].append(statistics.median(gaps))
        _, result["torch_loader"] = _windows_and_total(runs["torch"])
        result["step_s"] = steps
        _, total = _windows_and_total(runs["restartable"])
    else:
        iters = max(60, int(seconds / per_step.item()))
        samples, _ = train(itertools.cycle(data), iters, max_epochs=1, epoch_length=iters)
        _, total = _windows_and_total([samples])
    result.update(total)
    (outdir / f"cpu-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)


# -- per-step cost on the training thread ---------------------------------------------------------------
def per_call_us(fn, baseline, calls: int, repeats: int, clock=time.thread_time_ns) -> list[float]:
    """Microseconds per call of ``fn`` beyond ``baseline`` (the same loop doing nothing of ours),
    one value per repeat; the two loops alternate so drift hits both. The default clock is this
    thread's CPU time: time the training thread spends in the hooks, not time other processes of a
    shared machine took from it."""
    out = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            baseline()
        t1 = clock()
        for _ in range(calls):
            fn()
        t2 = clock()
        out.append(((t2 - t1) - (t1 - t0)) / calls / 1e3)
    return out


def _session(guard):
    """What owns the side group and the watchdog of an adapter's guard (``Session``; ``Coordinator``
    in releases before it)."""
    return getattr(guard, "session", None) or getattr(guard, "coord", None)


def _owner(func):
    """The object a (possibly event-filtered) Ignite handler is bound to."""
    owner = getattr(func, "__self__", None)
    parent = getattr(func, "_parent", None)
    if owner is None and parent is not None:
        owner = getattr(parent(), "__self__", None)
    return owner


def _fire(entries) -> None:
    """What ``Engine._fire_event`` does for each handler (weakly referenced engine first)."""
    import weakref

    for func, args, kwargs in entries:
        if args and isinstance(args[0], weakref.ref):
            func(args[0](), *args[1:], **kwargs)
        else:
            func(*args, **kwargs)


def _time_agreement(guard, calls: int, repeats: int) -> dict:
    """Wall time of one agreement (``guard.sync``) and of the bare one-int all_reduce on the side group."""
    import torch
    import torch.distributed as dist

    side = _session(guard).side
    flag = torch.zeros(1, dtype=torch.int64)
    sync, raw = [], []
    for _ in range(repeats):
        dist.barrier(group=side)
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            guard.sync("bench")
        t1 = time.perf_counter_ns()
        for _ in range(calls):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=side)
        t2 = time.perf_counter_ns()
        sync.append((t1 - t0) / calls / 1e3)
        raw.append((t2 - t1) / calls / 1e3)
    return {"agreement_us": sync, "all_reduce_us": raw, "sync_every": guard.sync_every}


def ignite_hooks(calls: int, repeats: int) -> dict:
    """The Ignite handler's per-iteration work, timed from inside a running ``Engine.run``."""
    import torch
    from ignite.engine import Engine, Events

    from fault_tolerant_handlers.ignite import FaultTolerance

    out: dict = {}
    engine = Engine(lambda e, b: None)
    ft = FaultTolerance().attach(engine)

    def probe(engine) -> None:
        if ft.guard.due(engine.state.iteration):
            raise RuntimeError("the probe iteration must not be an agreement iteration")
        entries = [e for event in (Events.ITERATION_STARTED, Events.ITERATION_COMPLETED)
                   for e in engine._event_handlers[event] if _owner(e[0]) is ft]
        if not entries:
            raise RuntimeError("FaultTolerance attached no per-iteration handler")
        out["handlers"] = [getattr(e[0], "__name__", repr(e[0])) for e in entries]
        out["hook_us"] = per_call_us(lambda: _fire(entries), lambda: _fire(()), calls, repeats)
        out.update(_time_agreement(ft.guard, max(20, calls // 50), repeats))

    engine.add_event_handler(Events.ITERATION_COMPLETED(once=5), probe)
    engine.run([torch.zeros(1)] * 10, max_epochs=1)
    return out


def lightning_hooks(calls: int, repeats: int) -> dict:
    """The Lightning callback's batch hooks, dispatched as the real ``Trainer`` dispatches them, from
    inside a running ``fit``; the baseline is the same dispatch with no callback."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.trainer.call import _call_callback_hooks

    from fault_tolerant_handlers.lightning import FaultTolerance

    out: dict = {}
    ft = FaultTolerance()

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx != 5:
                return
            saved = trainer.callbacks

            def step(callbacks):
                def run():
                    trainer.callbacks = callbacks
                    _call_callback_hooks(trainer, "on_train_batch_start", batch, batch_idx)
                    ft._batches = 0  # the next end hook counts batch 1: never an agreement batch
                    _call_callback_hooks(trainer, "on_train_batch_end", outputs, batch, batch_idx)
                return run

            def direct():
                ft.on_train_batch_start(trainer, module, batch, batch_idx)
                ft._batches = 0
                ft.on_train_batch_end(trainer, module, outputs, batch, batch_idx)

            saved_batches = ft._batches
            try:
                out["hook_us"] = per_call_us(step([ft]), step([]), calls, repeats)
                out["direct_us"] = per_call_us(direct, lambda: None, calls, repeats)
                out["noop_callback_us"] = per_call_us(step([pl.Callback()]), step([]), calls, repeats)
            finally:
                trainer.callbacks, ft._batches = saved, saved_batches
            out.update(_time_agreement(ft.guard, max(20, calls // 50), repeats))

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(accelerator="cpu", devices=torch.distributed.get_world_size(), num_nodes=1, strategy="ddp",
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ft, Probe()], use_distributed_sampler=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.randn(10, 4), batch_size=1))
    return out


def hooks_rank_main(outdir: Path, calls: int, repeats: int, frameworks: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    if "ignite" in frameworks:
        results["ignite"] = ignite_hooks(calls, repeats)
    if "lightning" in frameworks:
        results["lightning"] = lightning_hooks(calls, repeats)
    if dist.get_rank() == 0:
        (outdir / "hooks.json").write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)


# -- step-time ratio --------------------------------------------------------------------------------
def ab_rank_main(outdir: Path, pairs: int, iters: int, frameworks: list[str]) -> None:
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


# -- report -----------------------------------------------------------------------------------------
def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """``median (min-max)`` of ``values``."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def ratio_rows(results: dict) -> tuple[list[str], dict[str, float]]:
    rows = ["| framework/model | without (ms) | with (ms) | ratio median | ratio min-max over pairs |",
            "|---|---:|---:|---:|---:|"]
    worst: dict[str, float] = {}
    for key, (a, b) in results.items():
        ratios = [y / x for x, y in zip(a, b)]
        ratio = statistics.median(ratios)
        framework = key.split("/")[0]
        worst[framework] = max(worst.get(framework, 0.0), ratio)
        rows.append(f"| {key} | {statistics.median(a) * 1e3:.2f} | {statistics.median(b) * 1e3:.2f} | {ratio:.3f} "
                    f"| {min(ratios):.3f}-{max(ratios):.3f} |")
    return rows, worst


def cpu_rows(by_world: dict[str, list[dict]]) -> tuple[list[str], float]:
    """Per world size: the library's CPU per rank (median and min-max over ranks and over windows)."""
    rows = ["| ranks | library CPU per rank, % of a core: median (min-max over ranks) | over 1/10-run windows "
            "| /proc stat (10 ms ticks) | rank process CPU, % | store ops / rank / s | steps / s |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for world, ranks in by_world.items():
        precise = [r["sched"] if r["sched"] is not None else r["stat"] for r in ranks]
        windows = [w["sched"] if w["sched"] is not None else w["stat"] for r in ranks for w in r["windows"]]
        worst = max(worst, max(precise))
        pct = lambda values: spread([100 * v for v in values], "{:.3f}")  # noqa: E731
        rows.append(f"| {world} | {pct(precise)} | {pct(windows)} | {pct([r['stat'] for r in ranks])} "
                    f"| {statistics.median(100 * r['process'] for r in ranks):.0f} "
                    f"| {statistics.median(r['store_ops_per_s'] for r in ranks):.1f} "
                    f"| {statistics.median(r['steps_per_s'] for r in ranks):.0f} |")
    return rows, worst


def thread_rows(by_world: dict[str, list[dict]]) -> list[str]:
    """Which library thread takes what (median over ranks, % of a core)."""
    rows = ["| ranks | thread | % of a core, median (min-max over ranks) |", "|---:|---|---:|"]
    for world, ranks in by_world.items():
        names: dict[str, list[float]] = {}
        for r in ranks:
            for label, (stat, sched) in r["threads"].items():
                names.setdefault(label.split("/")[0], []).append(100 * (sched if sched is not None else stat))
        for name, values in sorted(names.items()):
            rows.append(f"| {world} | {name} | {spread(values, '{:.3f}')} |")
    return rows


def loader_rows(by_world: dict[str, list[dict]]) -> tuple[list[str], float]:
    """Per world size fed by a loader: step time with torch's DataLoader and with ours, and the
    library's CPU beside each (median (min-max) over ranks of each rank's figure)."""
    rows = ["| ranks | step, torch DataLoader (ms) | step, RestartableDataLoader (ms) | step ratio ours/torch "
            "| library CPU per rank with torch's loader, % of a core | with ours, % | of which fth-dataloader-pump, % |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for world, ranks in by_world.items():
        sched = lambda r: r["sched"] if r["sched"] is not None else r["stat"]  # noqa: E731
        torch_ms = [1e3 * statistics.median(r["step_s"]["torch"]) for r in ranks]
        ours_ms = [1e3 * statistics.median(r["step_s"]["restartable"]) for r in ranks]
        ratios = [o / t for o, t in zip(ours_ms, torch_ms)]
        pump = [100 * sum(v[1] if v[1] is not None else v[0] for k, v in r["threads"].items()
                          if k.startswith("fth-dataloader-pump")) for r in ranks]
        worst = max(worst, max(sched(r) for r in ranks))
        rows.append(f"| {world} | {spread(torch_ms, '{:.2f}')} | {spread(ours_ms, '{:.2f}')} | {spread(ratios)} "
                    f"| {spread([100 * sched(r['torch_loader']) for r in ranks])} "
                    f"| {spread([100 * sched(r) for r in ranks])} | {spread(pump)} |")
    return rows, worst


def hook_rows(hooks: dict) -> tuple[list[str], float]:
    rows = ["| adapter | hooks per step (us) | agreement (us) | bare all_reduce (us) | sync_every "
            "| per step: hooks + agreement / sync_every (us) |", "|---|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for framework, h in hooks.items():
        hook = statistics.median(h["hook_us"])
        agree = statistics.median(h["agreement_us"])
        every = h["sync_every"] or 0
        total = hook + (agree / every if every else 0.0)
        worst = max(worst, total)
        rows.append(f"| {framework} | {spread(h['hook_us'], '{:.2f}')} | {spread(h['agreement_us'], '{:.0f}')} "
                    f"| {spread(h['all_reduce_us'], '{:.0f}')} | {every or 'None'} | {total:.2f} |")
    for framework, h in hooks.items():
        if "noop_callback_us" in h and "direct_us" in h:
            rows.append(f"{framework} hooks per step, split: the framework's dispatch of any callback (a no-op "
                        f"Callback) {spread(h['noop_callback_us'], '{:.2f}')} us; the callback's own code called "
                        f"directly {spread(h['direct_us'], '{:.2f}')} us")
    return rows, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer pairs, iterations and seconds (about 2 minutes)")
    parser.add_argument("--pairs", type=int, default=None, help="A/B pairs per model (default 10; --quick 4)")
    parser.add_argument("--iters", type=int, default=None, help="iterations per run of the small model (default 300; --quick 80)")
    parser.add_argument("--cpu-seconds", type=float, default=None,
                        help="training time per world size for the background CPU (default 30; --quick 8)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="world sizes for the background CPU")
    parser.add_argument("--loader-workers", type=int, default=2,
                        help="also measure ranks fed by a RestartableDataLoader with this many workers, beside "
                             "torch's DataLoader (0: skip)")
    parser.add_argument("--loader-worlds", type=int, nargs="+", default=[2],
                        help="world sizes for the loader's figures (default 2)")
    parser.add_argument("--frameworks", nargs="+", default=["ignite", "lightning"], choices=["ignite", "lightning"])
    parser.add_argument("--only", nargs="+", default=["ratio", "cpu", "hooks"], choices=["ratio", "cpu", "hooks"],
                        help="which figures to measure (default all three)")
    parser.add_argument("--rank-main", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["ratio", "cpu", "hooks"], default="ratio", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("pairs", "iters", "cpu_seconds"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.loader_workers < 0:
        parser.error(f"--loader-workers must be 0 or more, got {args.loader_workers}")
    if any(w < 2 for w in args.worlds + args.loader_worlds):
        parser.error(f"--worlds, --loader-worlds: every world size must be at least 2, got {args.worlds} "
                     f"{args.loader_worlds}")
    pairs = args.pairs or (4 if args.quick else 10)
    iters = args.iters or (80 if args.quick else 300)
    cpu_seconds = args.cpu_seconds or (8.0 if args.quick else 30.0)
    calls, repeats = (2000, 11) if args.quick else (5000, 31)
    if args.rank_main:
        if args.mode == "ratio":
            ab_rank_main(args.rank_main, pairs, iters, args.frameworks)
        elif args.mode == "cpu":
            cpu_rank_main(args.rank_main, cpu_seconds, args.loader_workers)
        else:
            hooks_rank_main(args.rank_main, calls, repeats, args.frameworks)
        return
    # one intra-op thread per rank, as torchrun sets: ranks x threads would oversubscribe the cores
    env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    common = ["--pairs", str(pairs), "--iters", str(iters), "--cpu-seconds", str(cpu_seconds),
              "--frameworks", *args.frameworks]
    if args.quick:
        common.append("--quick")
    print(f"handlers' overhead, gloo ranks on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"default settings")
    fields: list[str] = []
    if "ratio" in args.only:
        outdir = Path(tempfile.mkdtemp(prefix="overhead-"))
        run_job(2, [__file__, "--rank-main", str(outdir), "--mode", "ratio", *common], deadline=1800, env=env,
                quiet_ranks=False)
        rows, worst = ratio_rows(json.loads((outdir / "result.json").read_text()))
        print(f"\n1. step-time ratio with/without, 2 ranks, {pairs} A/B pairs x {iters} iterations "
              "(moves with the machine's other load)")
        print("\n".join(rows))
        fields += [f"{k}={v:.3f}" for k, v in worst.items()]
    if "cpu" in args.only:
        by_world: dict[str, list[dict]] = {}
        runs = [(world, 0) for world in args.worlds]
        runs += [(world, args.loader_workers) for world in args.loader_worlds] if args.loader_workers else []
        for world, workers in runs:
            outdir = Path(tempfile.mkdtemp(prefix="overhead-cpu-"))
            run_job(world, [__file__, "--rank-main", str(outdir), "--mode", "cpu", *common,
                            "--loader-workers", str(workers)],
                    deadline=180 + (30 if workers else 10) * world + (8 if workers else 4) * cpu_seconds, env=env, quiet_ranks=False)
            files = sorted(outdir.glob("cpu-*.json"))
            if len(files) != world:
                raise SystemExit(f"background CPU at {world} ranks: {len(files)} of {world} ranks reported")
            label = f"{world}" + (f", RestartableDataLoader({workers} workers)" if workers else "")
            by_world[label] = [json.loads(f.read_text()) for f in files]
        plain = {k: v for k, v in by_world.items() if "," not in k}
        fed = {k.split(",")[0]: v for k, v in by_world.items() if "," in k}
        _, worst = cpu_rows(plain)
        rows, _ = cpu_rows(by_world)
        print(f"\n2. background CPU of the library's own threads (fth-*), Ignite training of ~{cpu_seconds:.0f} s "
              "with FaultTolerance, target <= 0.5 % of a core per rank")
        print("\n".join(rows))
        print()
        print("\n".join(thread_rows(by_world)))
        fields.append(f"cpu_per_rank={worst:.5f}")
        if fed:
            rows, worst_fed = loader_rows(fed)
            print(f"\n2b. fed by a DataLoader ({args.loader_workers} workers, persistent): torch's own and "
                  "RestartableDataLoader alternately (torch, ours, ours, torch) in the same ranks; step time "
                  "from one iteration's end to the next, median (min-max over ranks)")
            print("\n".join(rows))
            fields.append(f"cpu_per_rank_loader={worst_fed:.5f}")
    if "hooks" in args.only:
        outdir = Path(tempfile.mkdtemp(prefix="overhead-hooks-"))
        run_job(2, [__file__, "--rank-main", str(outdir), "--mode", "hooks", *common], deadline=600, env=env,
                quiet_ranks=False)
        rows, worst = hook_rows(json.loads((outdir / "hooks.json").read_text()))
        print(f"\n3. per-step cost on the training thread, 2 ranks, median (min-max) over {repeats} repeats "
              f"of {calls} calls, target <= 20 us")
        print("\n".join(rows))
        fields.append(f"hook_us={worst:.2f}")
    print("overhead_ratio " + " ".join(fields))


if __name__ == "__main__":
    main()
