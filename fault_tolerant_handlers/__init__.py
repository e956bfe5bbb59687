"""Make distributed PyTorch training fail together instead of deadlocking.

Public names:

* :class:`fail_together`: a section that, if it raises on any rank, raises on every rank.
* :class:`one_rank_first`: exception-safe drop-in for ``ignite.distributed.one_rank_first``.
* :class:`PeerFailedError`: what the ranks that did not fail raise, naming the one that did.
"""

from .errors import PeerFailedError
from .sections import fail_together, one_rank_first

__all__ = ["PeerFailedError", "fail_together", "one_rank_first"]
__version__ = "0.1.0"
