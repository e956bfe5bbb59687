"""Public path of checkpoint discovery (defined in :mod:`.data.checkpoints`)."""

from .data.checkpoints import latest_checkpoint

__all__ = ["latest_checkpoint"]
