"""Public path of the watchdog (defined in :mod:`.detect.watchdog`)."""

from .detect.watchdog import EXIT_HUNG, EXIT_PEER_FAILED, Watchdog, start_watchdog, writing_checkpoint

__all__ = ["EXIT_HUNG", "EXIT_PEER_FAILED", "Watchdog", "start_watchdog", "writing_checkpoint"]
