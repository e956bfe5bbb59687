"""Public path of the errors the ranks raise (defined in :mod:`.core.errors`)."""

from .core.errors import PeerFailedError, SectionMismatchError, is_backend_error

__all__ = ["PeerFailedError", "SectionMismatchError", "is_backend_error"]
