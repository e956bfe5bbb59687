"""Random-kill campaigns against RestartableDataLoader (used by tests and bench/dataloader.py).

``campaign(kind, kills=..., seed=...)`` builds a loader of one kind, iterates it for several epochs
while a killer thread SIGKILLs a random live worker at random moments (the main thread is then
either waiting in ``next()`` or inside a simulated training step), and compares every epoch with
the same seeded loader run by stock ``torch.utils.data.DataLoader`` without kills.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, get_worker_info

from fault_tolerant_handlers.dataloader import RestartableDataLoader

SAMPLE_SEC = 0.002  # time a worker spends on one sample


class MapData(Dataset):
    def __init__(self, n: int, delay: float = SAMPLE_SEC) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.delay:
            time.sleep(self.delay)
        return i


class StreamData(IterableDataset):
    """Sharded by worker; keeps its position in ``state_dict`` (torchdata's Stateful protocol)."""

    def __init__(self, n: int, delay: float = SAMPLE_SEC) -> None:
        self.n, self.delay, self.pos = n, delay, None

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        if self.pos is None:
            self.pos = wid
        while self.pos < self.n:
            i = self.pos
            self.pos += nw
            if self.delay:
                time.sleep(self.delay)
            yield i
        self.pos = None

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class RandomChunks(Sampler):
    """A batch sampler with hidden state: batches of 1-6 indices drawn from its own ``random.Random``.

    Iterating it twice gives different epochs, so resuming by re-iterating or fast-forwarding it
    would be wrong: only a loader that never re-iterates it is exact.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.rng = n, random.Random(seed)

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        i = 0
        while i < self.n:
            k = self.rng.randint(1, 6)
            yield order[i : i + k]
            i += k

    def __len__(self) -> int:  # an upper bound is enough for these tests
        return self.n


KINDS = ["shuffle", "shuffle-persistent", "distributed", "batch-sampler", "iterable", "iterable-persistent"]


def make_loader(kind: str, cls=RestartableDataLoader, n: int = 400, rank: int = 0, **extra):
    """One loader of ``kind``; the same call with ``cls=DataLoader`` is the stock reference."""
    kw = dict(num_workers=2, **extra)
    if cls is DataLoader:
        kw.pop("max_restarts", None)
    if kind in ("shuffle", "shuffle-persistent"):
        return cls(MapData(n), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7),
                   persistent_workers=kind.endswith("persistent"), **kw)
    if kind == "distributed":
        sampler = DistributedSampler(MapData(n), num_replicas=2, rank=rank, shuffle=True, seed=3)
        return cls(MapData(n), batch_size=4, sampler=sampler, **kw)
    if kind == "batch-sampler":
        return cls(MapData(n), batch_sampler=RandomChunks(n, seed=11), **kw)
    if kind in ("iterable", "iterable-persistent"):
        return cls(StreamData(n), batch_size=4, persistent_workers=kind.endswith("persistent"), **kw)
    if kind == "no-collation":
        return cls(MapData(n), batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(5), **kw)
    raise ValueError(kind)


def epochs_of(loader, epochs: int, step_sec: float = 0.0, rng: random.Random | None = None) -> list[list[int]]:
    out = []
    for e in range(epochs):
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(e)
        got = []
        for batch in loader:
            got.extend(torch.as_tensor(batch).reshape(-1).tolist())
            if step_sec and rng is not None:
                time.sleep(rng.uniform(0, step_sec))  # the "training step"
        out.append(got)
    return out


def _is_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2 :].split()
        return int(fields[1]) == os.getpid() and fields[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


class Killer(threading.Thread):
    """SIGKILLs a random live worker of ``loader`` every ``uniform(0, 2 * gap)`` seconds."""

    def __init__(self, loader: RestartableDataLoader, gap: float, max_kills: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.loader, self.gap, self.max_kills = loader, gap, max_kills
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills: list[tuple[int, float]] = []  # (pid, time.time())

    def run(self) -> None:
        while not self.stop.is_set() and len(self.kills) < self.max_kills:
            if self.stop.wait(self.rng.uniform(0, 2 * self.gap)):
                return
            pids = [p for p in self.loader.worker_pids if _is_child(p)]
            if not pids:
                continue
            pid = self.rng.choice(pids)
            t = time.time()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append((pid, t))


def kill_children() -> None:
    """SIGKILL every process this process started through multiprocessing (by pid) and reap it."""
    for p in multiprocessing.active_children():
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.join(timeout=2)


@dataclass
class Result:
    kind: str
    epochs: int
    kills: int  # SIGKILLs sent to a live worker
    restarts: int
    lost: int  # samples of the reference missing from an epoch
    duplicated: int  # samples yielded more than once in an epoch
    order_ok: bool  # every epoch equal to the reference, in order
    detection_ms: list[float] = field(default_factory=list)
    restart_ms: list[float] = field(default_factory=list)
    recovery_ms: list[float] = field(default_factory=list)
    wall_sec: float = 0.0
    got: list = field(default_factory=list)


def _shut_down(loader) -> None:
    """End a stock loader's persistent workers now (and unregister them from torch's SIGCHLD check)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def campaign(kind: str, kills: int = 15, epochs: int = 3, gap: float = 0.05, seed: int = 0, rank: int = 0,
             n: int = 400) -> Result:
    """Run ``kind`` for ``epochs`` with up to ``kills`` random SIGKILLs; compare with stock."""
    stock = make_loader(kind, DataLoader, n=n, rank=rank)
    reference = epochs_of(stock, epochs)
    _shut_down(stock)  # its persistent workers must not outlive it: kill_children() below would hit them
    loader = make_loader(kind, n=n, rank=rank, max_restarts=10_000)
    killer = Killer(loader, gap, kills, seed)
    t0 = time.monotonic()
    try:
        killer.start()
        got = epochs_of(loader, epochs, step_sec=0.004, rng=random.Random(seed))
    finally:
        killer.stop.set()
        killer.join(timeout=5)
        kill_children()
    wall = time.monotonic() - t0
    lost = dup = 0
    for want, have in zip(reference, got):
        counts = collections.Counter(have)
        lost += sum(1 for i in set(want) if counts[i] == 0)
        dup += sum(c - 1 for c in counts.values() if c > 1)
    kill_at = {pid: t for pid, t in killer.kills}
    res = Result(kind, epochs, len(killer.kills), loader.restart_count, lost, dup, got == reference, wall_sec=wall, got=got)
    for r in loader.restarts:
        if r.worker_pid in kill_at:
            res.detection_ms.append(1000 * (r.detected_at - kill_at[r.worker_pid]))
        res.restart_ms.append(1000 * r.restart_seconds)
        if r.recovery_seconds is not None:
            res.recovery_ms.append(1000 * r.recovery_seconds)
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]
