"""What a recovery in place's steps are told (:class:`RecoveryState`): a hook's ``step(state)`` returns a
new state (``dataclasses.replace``) or ``None`` (unchanged); who does what is listed in ``wiring.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


#: The name ``latest_checkpoint`` answers with when live state serves (no such file is ever written).
LIVE_NAME = "live-state-step={step}.pt"


@dataclass
class Captured:
    """One rank's state as of the last step it completed, in the form its framework loads."""

    step: int  #: the step completed (Ignite: the engine's iteration; Lightning: the global step)
    unit: str  #: ``"iteration"`` or ``"global step"``
    state: Any  #: what the checkpoint would hold (a dict of state dicts)
    directory: str | None  #: where that loop's checkpoints are written (resolved), if known
    rng: tuple | None = None  #: the RNG states at the start of the next step, if recorded (``core.rng_state``)


@dataclass(frozen=True)
class RecoveryState:
    """What a recovery's steps are told: one value, replaced (never changed) by a step that adds to it."""

    rank: int = -1  #: this rank in the group the attempts share (-1: not known yet)
    world_size: int = -1
    store: Any = None  #: the store of the first attempt's group, without its prefixes
    attempt: int = 0  #: the in-place attempt that failed (:func:`..core.attempts.in_place`)
    cause: Any = None  #: the failure (a ``core.failure.FailureRecord``): the agreed one
    plan: Any = None  #: where the next attempt's state comes from (``recover.live_state.LivePlan``), once agreed
    live: Captured | None = None  #: this rank's live state (``CAPTURE_LIVE``), or what to hold (``SETTLE_LIVE``)
    live_why: str = ""  #: why there is no live state to capture
    #: shard snapshots held here (``CAPTURE_LIVE``): partners' copies and this rank's own replicas
    copies: tuple = ()
    timings: dict = field(default_factory=dict, compare=False)  #: the recovery's moments (``time.monotonic()``)
