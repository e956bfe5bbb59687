"""Recovering in place: the same processes re-form the group and call the training function again.
It stands on :mod:`..core` only: the launchers, the data layer and the adapters register their parts
of a recovery in its phases (:mod:`..core.phases`)."""

from .inplace import INTERRUPT_SIGNAL, recover_in_place, recovery_attempt
from .spares import spares_left

__all__ = ["INTERRUPT_SIGNAL", "recover_in_place", "recovery_attempt", "spares_left"]
