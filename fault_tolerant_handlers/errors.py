"""Public path of the errors the ranks raise (defined in :mod:`.core.errors`), and of what they
carry as data (:mod:`.core.failure`)."""

from .core.errors import PeerFailedError, SectionMismatchError, is_backend_error
from .core.failure import Ended, FailureKind

__all__ = ["Ended", "FailureKind", "PeerFailedError", "SectionMismatchError", "is_backend_error"]
