"""Rehearse a failure in your own job, without editing it: ``FTH_INJECT="raise@rank=1,iteration=5"``
fires once at the start of that iteration (the adapters, a ``fail_together(step=...)`` section or
:func:`step`), in attempt 0 unless ``attempt=`` says otherwise (docs/rehearsing.md)."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Any

from .hooks import log
from . import attempts, hooks

#: The environment variable the adapters read.
INJECT_ENV = "FTH_INJECT"
KINDS = ("raise", "kill", "hang", "worker-kill", "lose")
FORMS = (
    "'<kind>@rank=<int>,iteration=<int>[,epoch=<int>][,attempt=<int>|any]' with <kind> one of "
    + ", ".join(KINDS)
    + "; several separated by ';' (e.g. FTH_INJECT=\"raise@rank=1,iteration=5\")"
)
_SPEC = re.compile(r"^\s*(?P<kind>[a-z-]+)\s*@\s*(?P<args>.*?)\s*$")


class InjectedFault(RuntimeError):
    """What ``raise@...`` raises."""


@dataclass(frozen=True)
class Injection:
    kind: str
    rank: int
    iteration: int
    epoch: int | None = None
    attempt: int | None = 0  #: None: every attempt

    def __str__(self) -> str:
        epoch = f",epoch={self.epoch}" if self.epoch is not None else ""
        attempt = "" if self.attempt == 0 else f",attempt={'any' if self.attempt is None else self.attempt}"
        return f"{self.kind}@rank={self.rank},iteration={self.iteration}{epoch}{attempt}"


def parse(text: str) -> list[Injection]:
    """Parse an ``FTH_INJECT`` value (``ValueError`` naming the bad part and the accepted forms)."""
    if not isinstance(text, str):
        raise TypeError(f"{INJECT_ENV} must be a string of the form {FORMS}, got {text!r}")
    injections = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        def bad(what: str) -> ValueError:
            return ValueError(f"{INJECT_ENV}: {what} in {part!r}; accepted: {FORMS}")

        match = _SPEC.match(part)
        if match is None:
            raise ValueError(f"{INJECT_ENV}: cannot read {part!r}; accepted: {FORMS}")
        kind = match.group("kind")
        if kind not in KINDS:
            raise bad(f"unknown kind {kind!r}")
        fields: dict[str, int | None] = {}
        for item in (i for i in match.group("args").split(",") if i.strip()):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in ("rank", "iteration", "epoch", "attempt"):
                raise bad(f"unknown field {item.strip()!r}")
            if key in fields:
                raise bad(f"{key} given twice")
            if key == "attempt" and value == "any":
                fields[key] = None
            elif re.fullmatch(r"\d+", value):
                fields[key] = int(value)
            else:
                raise bad(f"{key}={value!r} is not a non-negative int")
        missing = [k for k in ("rank", "iteration") if k not in fields]
        if missing:
            raise bad(f"{' and '.join(missing)} missing")
        if fields["iteration"] < 1:
            raise bad("iteration counts from 1, got 0")
        injections.append(Injection(kind, fields["rank"], fields["iteration"], fields.get("epoch"),
                                    fields.get("attempt", 0)))
    return injections


class Injector:
    """Fires the injections meant for this rank, each once."""

    def __init__(self, injections: list[Injection]) -> None:
        self.pending = list(injections)

    @classmethod
    def from_env(cls) -> Injector | None:
        """The injections of ``FTH_INJECT`` meant for this attempt (``TORCHELASTIC_RESTART_COUNT``)."""
        text = os.environ.get(INJECT_ENV, "")
        if not text.strip():
            return None
        injections = parse(text)
        current = attempts.current()
        return cls([i for i in injections if i.attempt is None or i.attempt == current])

    def maybe_fire(self, rank: int, iteration: int, epoch: int | None = None, dataloader: Any = None) -> None:
        global _told
        _told = True
        for injection in list(self.pending):
            if injection.rank != rank or injection.iteration != iteration:
                continue
            if injection.epoch is not None and injection.epoch != epoch:
                continue
            self.pending.remove(injection)
            self._fire(injection, dataloader, iteration)

    def _fire(self, injection: Injection, dataloader: Any, step: int) -> None:
        log(logging.WARNING, "%s=%s: injecting %s", INJECT_ENV, injection, injection.kind, step=step)
        if injection.kind == "raise":
            raise InjectedFault(f"injected by {INJECT_ENV}: {injection}")
        if injection.kind == "lose":
            for lose in hooks.callbacks(hooks.LOSE):  # its keeper, if any, will not replace it
                lose()
        if injection.kind in ("kill", "lose"):
            os.kill(os.getpid(), signal.SIGKILL)
        if injection.kind == "hang":
            while True:
                time.sleep(3600)
        if injection.kind == "worker-kill":
            pids = list(getattr(dataloader, "worker_pids", None) or [])
            if not pids:
                pids = [p.pid for p in multiprocessing.active_children() if p.pid]
            if not pids:
                log(logging.WARNING, "%s: no DataLoader worker to kill (num_workers=0?)", injection, step=step)
                return
            os.kill(pids[0], signal.SIGKILL)


# -- loops of your own: fail_together(step=...) sections and step() --------------------------------------

_told = False  #: something in this process told an injector an iteration (an adapter, a section, step())
_plain: tuple[tuple[str, int], Injector | None] | None = None  #: (FTH_INJECT, attempt) -> its injector
_exit_check: list[int] = []  #: the rank whose unfired injections are named at exit (registered once)


def current_rank() -> int:
    """This process's global rank: the process group's, else ``RANK`` (0 without either)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def plain_injector() -> Injector | None:
    """This process's injector for loops of your own, one per attempt (one nothing fired is named at exit)."""
    global _plain
    key = (os.environ.get(INJECT_ENV, ""), attempts.current())
    if _plain is None or _plain[0] != key:
        injector = Injector.from_env()
        _plain = (key, injector)
        rank = current_rank()
        if injector is not None and any(i.rank == rank for i in injector.pending) and not _exit_check:
            _exit_check.append(rank)
            atexit.register(_unfired)
    return _plain[1]


def step(iteration: int, epoch: int | None = None, *, dataloader: Any = None) -> None:
    """In a loop of your own: iteration ``iteration`` begins. Fires the ``FTH_INJECT`` injection meant
    for this rank at this iteration (and ``epoch``), once. ``dataloader``: whose worker ``worker-kill``
    kills (by default, any child process).

    Examples:
        .. code-block:: python

            for epoch in range(epochs):
                for i, batch in enumerate(loader):
                    inject.step(epoch * len(loader) + i + 1, epoch)  # FTH_INJECT=raise@rank=1,iteration=5
                    train_step(batch)
    """
    for name, value in (("iteration", iteration), ("epoch", epoch)):
        if (value is not None or name == "iteration") and (isinstance(value, bool) or not isinstance(value, int)
                                                          or value < 0):
            raise TypeError(f"inject.step({name}=...) must be an int >= 0{'' if name == 'iteration' else ' or None'}, "
                            f"got {value!r}")
    injector = plain_injector()
    if injector is not None:
        injector.maybe_fire(current_rank(), iteration, epoch, dataloader)


def _unfired() -> None:
    """At exit: the injections meant for this rank that nothing could fire, named with why."""
    injector = _plain[1] if _plain is not None else None
    rank = _exit_check[0] if _exit_check else None
    if _told or injector is None:
        return
    left = [i for i in injector.pending if i.rank == rank]
    if left:
        log(logging.WARNING, "%s=%s: nothing fired on rank %s: nothing in this job told the library its iteration. An "
            "injection fires at the start of the matching iteration of the Ignite handler or the Lightning callback; in "
            "a loop of your own, give each step's section its step (fail_together(name, step=N)) or call "
            "fault_tolerant_handlers.inject.step(N) at the start of each iteration (docs/rehearsing.md)",
            INJECT_ENV, "; ".join(str(i) for i in left), rank)


# Its public path (:mod:`fault_tolerant_handlers.inject`): what a failing rank's record names.
InjectedFault.__module__ = "fault_tolerant_handlers.inject"
