"""What a recovery in place's steps are told (:class:`RecoveryState`), and who does what at each
of its hooks (:mod:`.hooks`: ``hooks.run(hook, state)``), so that the recovery imports no layer beside it.

===================  ====================================================  ==============================================
hook                 when                                                  registered steps (in order)
===================  ====================================================  ==============================================
``BEGIN``            ``recover_in_place`` starts in this process           launchers: keep the first rendezvous's store
``CAPTURE_LIVE``     this rank's live state of the failed attempt          data: its capture (``state.live``), or why
                                                                           there is none (``state.live_why``)
``SETTLE_LIVE``      what the next attempt resumes from is settled         data: hold ``state.live`` (``None``: the
                     (again after a transfer from another rank)            newest checkpoint)
``TEAR_DOWN``        before the failed attempt's groups are destroyed      launchers: delete this rank's address keys
``RESET_FRAMEWORKS`` the library's sessions and the groups are gone        adapters: Ignite's ``idist`` model back to a
                                                                           fresh process's; ``Checkpoint.load_objects``
                                                                           resolves the live state's name (tolerated)
``COLLECTED``        the failed attempt's objects are collected            data: reap the DataLoader workers left
``RE_FORM``          the next attempt's group is formed                    launchers: re-make the rendezvous over
                                                                           ``state.store`` under the new namespace
``END``              ``recover_in_place`` ends in this process              launchers: forget the first rendezvous; data:
                                                                           forget the live state and snapshots
===================  ====================================================  ==============================================

A step is a callable ``step(state)`` that returns a new state (``dataclasses.replace(state, ...)``) or
``None`` (the state is unchanged). The launchers also answer ``hooks.WORLD`` (the first rendezvous's
store, rank and world size), a provider, not a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    cause: Any = None  #: the failure's cause (``core.recoveries.RecoveryCause``): the agreed one
    plan: Any = None  #: where the next attempt's state comes from (``recover.causes.LivePlan``), once agreed
    live: Captured | None = None  #: this rank's live state (``CAPTURE_LIVE``), or what to hold (``SETTLE_LIVE``)
    live_why: str = ""  #: why there is no live state to capture
    #: shard snapshots held here (``CAPTURE_LIVE``): partners' copies and this rank's own replicas
    copies: tuple = ()
    timings: dict = field(default_factory=dict, compare=False)  #: the recovery's moments (``time.monotonic()``)
