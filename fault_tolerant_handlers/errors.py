"""Public path of the errors the ranks raise (defined in :mod:`.core.errors`), and of what they
carry as data (:mod:`.core.failure`)."""

from .core.compat_torch import is_backend_error
from .core.errors import SectionMismatchError
from .core.failure import Ended, FailureKind, PeerFailedError

__all__ = ["Ended", "FailureKind", "PeerFailedError", "SectionMismatchError", "is_backend_error"]
