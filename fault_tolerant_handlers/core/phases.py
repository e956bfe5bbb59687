"""The phases of a recovery in place, and who does what in each: the recovery (:mod:`..recover.inplace`)
runs the phases in order over one :class:`RecoveryState`; each layer registers its own part at import,
as the launchers subscribe to the core's events, so that the recovery imports no layer beside it.

===================  ====================================================  ==============================================
phase                when                                                  registered steps (in order)
===================  ====================================================  ==============================================
``BEGIN``            ``recover_in_place`` starts in this process           launchers: keep the first rendezvous's store
``WORLD``            the recovery asks what its attempts share             launchers: the first rendezvous's store, rank
                                                                           and world size (a step returns the state)
``RECORD``           the failure is recorded, the watchdogs stopped        -
``CAPTURE_LIVE``     this rank's live state of the failed attempt          data: its capture (``state.live``), or why
                                                                           there is none (``state.live_why``)
``AGREE``            every rank follows rank 0's decision                  -
``SETTLE_LIVE``      what the next attempt resumes from is settled         data: hold ``state.live`` (``None``: the
                     (again after a transfer from another rank)            newest checkpoint)
``TEAR_DOWN``        before the failed attempt's groups are destroyed      launchers: delete this rank's address keys
``RESET_FRAMEWORKS`` the library's sessions and the groups are gone        adapters: Ignite's ``idist`` model back to a
                                                                           fresh process's; ``Checkpoint.load_objects``
                                                                           resolves the live state's name (tolerated)
``COLLECTED``        the failed attempt's objects are collected            data: reap the DataLoader workers left
``RE_FORM``          the next attempt's group is formed                    launchers: re-make the rendezvous over
                                                                           ``state.store`` under the new namespace
``CALL_AGAIN``       the training function is about to be called again     -
``END``              ``recover_in_place`` ends in this process              launchers: forget the first rendezvous; data:
                                                                           forget the live state and snapshots
===================  ====================================================  ==============================================

A step is a callable ``step(state)`` that returns a new state (``dataclasses.replace(state, ...)``) or
``None`` (the state is unchanged); steps run in the order they were registered. A step's exception
stops the recovery, as the same code did when the recovery called it itself, unless it was registered
with ``tolerate=True``: then it is logged and the next step runs.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .log import first_line, log


class Phase(enum.Enum):
    """A moment of a recovery in place at which layers act (see the module's table)."""

    BEGIN = "begin"
    WORLD = "world"
    RECORD = "record"
    CAPTURE_LIVE = "capture live state"
    AGREE = "agree"
    SETTLE_LIVE = "settle live state"
    TEAR_DOWN = "tear down"
    RESET_FRAMEWORKS = "reset frameworks"
    COLLECTED = "collected"
    RE_FORM = "re-form"
    CALL_AGAIN = "call again"
    END = "end"


#: The name :func:`~fault_tolerant_handlers.latest_checkpoint` answers with (in the directory it was
#: asked about) when live state serves: no such file is ever written.
LIVE_NAME = "live-state-step={step}.pt"


@dataclass
class Captured:
    """One rank's state as of the last step it completed, in the form its framework loads."""

    step: int  #: the step completed (Ignite: the engine's iteration; Lightning: the global step)
    unit: str  #: ``"iteration"`` or ``"global step"``
    state: Any  #: what the checkpoint would hold (a dict of state dicts)
    directory: str | None  #: where that loop's checkpoints are written (resolved), if known
    rng: tuple | None = None  #: torch's RNG states at the start of the next step, if recorded


@dataclass(frozen=True)
class RecoveryState:
    """What a recovery's steps are told: one value, replaced (never changed) by a step that adds to it."""

    rank: int = -1  #: this rank in the group the attempts share (-1: not known yet)
    world_size: int = -1
    store: Any = None  #: the store of the first attempt's group, without its prefixes
    attempt: int = 0  #: the in-place attempt that failed (:func:`..core.attempts.in_place`)
    cause: Any = None  #: the failure's cause (``recover.causes.Cause``): this rank's own in ``RECORD``, then the agreed one
    plan: Any = None  #: where the next attempt's state comes from (``recover.causes.LivePlan``), once agreed
    live: Captured | None = None  #: this rank's live state (``CAPTURE_LIVE``), or what to hold (``SETTLE_LIVE``)
    live_why: str = ""  #: why there is no live state to capture
    timings: dict = field(default_factory=dict, compare=False)  #: the recovery's moments (``time.monotonic()``)


Step = Callable[[RecoveryState], "RecoveryState | None"]

_steps: dict[Phase, tuple[tuple[Step, bool], ...]] = {phase: () for phase in Phase}
_lock = threading.Lock()


def register(phase: Phase, step: Step, *, tolerate: bool = False) -> None:
    """Run ``step(state)`` in ``phase`` of every recovery, after the steps registered before it (once,
    however often registered). ``tolerate``: its exception is logged and the recovery goes on."""
    if not isinstance(phase, Phase):
        raise ValueError(f"register(phase, step): phase must be a Phase ({', '.join(p.name for p in Phase)}), "
                         f"got {phase!r}")
    if not callable(step):
        raise TypeError(f"register(phase, step): step must be a callable taking a RecoveryState, got {step!r}")
    with _lock:
        if all(s != step for s, _ in _steps[phase]):
            _steps[phase] = (*_steps[phase], (step, tolerate))  # replaced, never mutated: run reads no lock


def unregister(phase: Phase, step: Step) -> None:
    with _lock:
        _steps[phase] = tuple(entry for entry in _steps[phase] if entry[0] != step)


def steps(phase: Phase) -> tuple[Step, ...]:
    return tuple(step for step, _ in _steps[phase])


def run(phase: Phase, state: RecoveryState) -> RecoveryState:
    """Run ``phase``'s steps in order over ``state``; returns the state the last one left."""
    for step, tolerate in _steps[phase]:
        try:
            new = step(state)
        except Exception as err:
            if not tolerate:
                raise
            log(logging.WARNING, "recovery phase %s: a step (%s) failed, the recovery goes on: %s: %s", phase.value,
                getattr(step, "__qualname__", step), type(err).__name__, first_line(err))
            continue
        if new is not None:
            if not isinstance(new, RecoveryState):
                raise TypeError(f"recovery phase {phase.value}: a step ({getattr(step, '__qualname__', step)}) "
                                f"returned {type(new).__name__}, not a RecoveryState or None")
            state = new
    return state
