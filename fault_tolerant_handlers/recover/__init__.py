"""Recovering in place: the same processes re-form the group and call the training function again.
It stands on :mod:`..core` only: the launchers', the data layer's and the adapters' parts of a
recovery, and the recovery's own answers to the detectors, are listed in one table
(``fault_tolerant_handlers/wiring.py``), which adds them to the core's hooks."""

from .inplace import INTERRUPT_SIGNAL, recover_in_place, recovery_attempt
from .spares import spares_left

__all__ = ["INTERRUPT_SIGNAL", "recover_in_place", "recovery_attempt", "spares_left"]
