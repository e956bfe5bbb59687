"""Recovering in place: the same processes re-form the group and call the training function again.
It stands on the layers below (core, detect, launchers, data), like the adapters."""

from .inplace import INTERRUPT_SIGNAL, recover_in_place, recovery_attempt

__all__ = ["INTERRUPT_SIGNAL", "recover_in_place", "recovery_attempt"]
