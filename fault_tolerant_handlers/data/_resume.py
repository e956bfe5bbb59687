"""Where a pass of a ``RestartableDataLoader`` is, as a small snapshot of plain types, and how to go
back there (docs/recovering.md): map-style, what decided the pass's order at its sampler's first draw
(sampler epoch, generator states, torch's global RNG when a sampler may use it), and a resume draws
the batches already yielded again (indices only); iterable datasets, torchdata's state."""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from . import compat_dataloader as _compat

#: Version of the snapshot layout; ``load_state_dict`` refuses others.
STATE_VERSION = 1
_REQUIRED = ("version", "kind", "epoch", "batches_yielded", "epoch_finished")
_KNOWN_SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler, BatchSampler)


def _unique(objects) -> list[Any]:
    found: list[Any] = []
    for obj in objects:
        if obj is not None and all(obj is not o for o in found):
            found.append(obj)
    return found


def _samplers(loader) -> list[Any]:
    """The batch sampler, the sampler inside it and the loader's sampler, each once."""
    return _unique((loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None), loader.sampler))


def _generators(loader) -> list[torch.Generator]:
    """Every ``torch.Generator`` the loader and its samplers hold, in a fixed order, each once."""
    gens = (getattr(obj, "generator", None) for obj in [loader, *_samplers(loader)])
    return _unique(g for g in gens if isinstance(g, torch.Generator))


def _uses_global_rng(loader) -> bool:
    """True when the epoch's order may come from torch's global RNG."""
    for obj in _samplers(loader):
        if isinstance(obj, RandomSampler) and obj.generator is None:
            return True
        if not isinstance(obj, _KNOWN_SAMPLERS) and getattr(obj, "generator", None) is None:
            return True  # a custom sampler: it may draw from the global RNG
    return False


def sampler_epoch_owner(loader) -> Any:
    """The sampler whose ``epoch`` attribute (``set_epoch``) decides the order, if any."""
    return next((obj for obj in _samplers(loader)
                 if callable(getattr(obj, "set_epoch", None)) and isinstance(getattr(obj, "epoch", None), int)), None)


def sampler_epoch(loader) -> int | None:
    owner = sampler_epoch_owner(loader)
    return int(owner.epoch) if owner is not None else None


class _Capture:
    """Records what decides an epoch's order, at the first draw from its sampler iterator."""

    def __init__(self, loader, source: Iterator[Any], snapshot: Mapping[str, Any] | None = None) -> None:
        self._loader = weakref.ref(loader)  # the iterator keeps this: no cycle back to the loader
        self._source = source
        self.taken = snapshot is not None  # a resumed epoch: its starting point is the snapshot's
        self.sampler_epoch: int | None = snapshot["sampler_epoch"] if snapshot is not None else None
        self.generators: list[torch.Tensor] = list(snapshot["generators"]) if snapshot is not None else []
        self.global_rng: torch.Tensor | None = snapshot["global_rng"] if snapshot is not None else None

    def take(self) -> None:
        loader = self._loader()
        if loader is None:
            return
        self.sampler_epoch = sampler_epoch(loader)
        self.generators = [g.get_state() for g in _generators(loader)]
        self.global_rng = torch.get_rng_state() if _uses_global_rng(loader) else None
        self.taken = True

    def __iter__(self) -> "_Capture":
        return self

    def __next__(self) -> Any:
        if not self.taken:
            self.take()
        return next(self._source)


def source(loader, snapshot: Mapping[str, Any] | None) -> _Capture:
    """The sampler iterator of a new pass (its starting point recorded at its first draw), or of the
    snapshot's, after its ``batches_yielded`` batches (the global RNG borrowed and given back)."""
    if snapshot is None:
        return _Capture(loader, iter(_compat.index_sampler(loader)))
    owner = sampler_epoch_owner(loader)
    if snapshot["sampler_epoch"] is not None and owner is not None:
        owner.set_epoch(snapshot["sampler_epoch"])
    restore_generators(loader, snapshot)
    outer = torch.get_rng_state()
    if snapshot["global_rng"] is not None:
        torch.set_rng_state(snapshot["global_rng"])
    try:
        source = iter(_compat.index_sampler(loader))
        skipped = sum(1 for _ in itertools.islice(source, snapshot["batches_yielded"]))
        ahead = list(itertools.islice(source, 1))  # the sampler's draws happen here, not in a worker later
    finally:
        if snapshot["global_rng"] is not None:
            torch.set_rng_state(outer)
    if skipped != snapshot["batches_yielded"]:
        raise ValueError(
            f"RestartableDataLoader.load_state_dict: the snapshot is {snapshot['batches_yielded']} batches into the "
            f"loader's pass {snapshot['epoch'] + 1}, but the sampler now gives only {skipped} batches; build the loader (dataset, "
            "sampler, batch size, world size) as it was when the snapshot was taken"
        )
    return _Capture(loader, itertools.chain(ahead, source), snapshot)


def map_state(loader, epoch: int, yielded: int, finished: bool, capture: _Capture | None) -> dict[str, Any]:
    """The snapshot of a map-style loader: inside an epoch, the generator states its sampler started
    from; after an epoch (or before the first), their states now, which the next epoch starts from."""
    if finished or capture is None:
        return {**_head("map", epoch, yielded, True), "sampler_epoch": None,
                "generators": [g.get_state() for g in _generators(loader)], "global_rng": None}
    if not capture.taken:
        capture.take()  # nothing drawn yet: what the first draw will see is what decides the epoch
    return {**_head("map", epoch, yielded, False), "sampler_epoch": capture.sampler_epoch,
            "generators": [s.clone() for s in capture.generators],
            "global_rng": capture.global_rng.clone() if capture.global_rng is not None else None}


def _head(kind: str, epoch: int, yielded: int, finished: bool) -> dict[str, Any]:
    return {"version": STATE_VERSION, "kind": kind, "epoch": epoch, "batches_yielded": yielded,
            "epoch_finished": finished}


def restore_generators(loader, snapshot: Mapping[str, Any]) -> None:
    """Before a new epoch after a finished one: the generators where the snapshot's loader left them."""
    gens = _generators(loader)
    states = snapshot.get("generators") or []
    if len(states) != len(gens):
        raise ValueError(
            f"RestartableDataLoader.load_state_dict: the snapshot holds {len(states)} generator state(s) but this "
            f"loader and its samplers hold {len(gens)} torch.Generator(s); build the loader as it was when the "
            "snapshot was taken"
        )
    for gen, state in zip(gens, states):
        gen.set_state(state)


def iterable_state(epoch: int, yielded: int, finished: bool, inner: Mapping[str, Any] | None) -> dict[str, Any]:
    return {**_head("iterable", epoch, yielded, finished), "torchdata": dict(inner) if inner is not None else None}


def check_state(state: Any, kind: str) -> dict[str, Any]:
    """Validate a snapshot given to ``load_state_dict``; return a shallow copy."""
    where = "RestartableDataLoader.load_state_dict(state_dict)"
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: expected a dict from RestartableDataLoader.state_dict(), got {type(state).__name__}")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"{where}: missing required key(s) {missing}; got keys {sorted(state)}")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"{where}: snapshot version {state['version']!r} is not supported (expected {STATE_VERSION})")
    if state["kind"] != kind:
        raise ValueError(f"{where}: the snapshot is of a {state['kind']!r}-style loader, this loader is {kind!r}-style")
    for key in ("epoch", "batches_yielded"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (-1 if key == "epoch" else 0):
            raise ValueError(f"{where}: {key}={value!r} must be an int >= {-1 if key == 'epoch' else 0}")
    if not isinstance(state["epoch_finished"], bool):
        raise ValueError(f"{where}: epoch_finished={state['epoch_finished']!r} must be a bool")
    out = dict(state)
    if kind == "map":
        out = {"sampler_epoch": None, "generators": [], "global_rng": None, **out}
        if not isinstance(out["generators"], (list, tuple)) or not all(
            isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in out["generators"]
        ):
            raise ValueError(f"{where}: generators must be a list of uint8 tensors (generator states)")
    return out


def resumes_mid_epoch(state: Mapping[str, Any]) -> bool:
    """False when the snapshot's epoch is over (or none had started): the next ``iter()`` starts a new one."""
    return state["epoch"] >= 0 and not state["epoch_finished"]
