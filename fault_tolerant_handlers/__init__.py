"""Make distributed PyTorch training fail together instead of deadlocking.

Public names:

* :class:`fail_together`: a section that, if it raises on any rank, raises on every rank.
* :class:`one_rank_first`: exception-safe drop-in for ``ignite.distributed.one_rank_first``.
* :class:`PeerFailedError`: what the ranks that did not fail raise, naming the one that did.
* :func:`start_watchdog`: the out-of-band watchdog (the adapters start it for you).
* :class:`RestartableDataLoader`, :func:`make_restartable`: a DataLoader that survives worker death.
* :func:`latest_checkpoint`: the newest complete checkpoint in a directory, the same on every rank.
"""

from . import _compat_torchrun
from .checkpoints import latest_checkpoint
from .dataloader import DataLoaderRestartError, RestartableDataLoader, WorkerRestart, make_restartable
from .errors import PeerFailedError
from .sections import fail_together, one_rank_first
from .watchdog import EXIT_HUNG, EXIT_PEER_FAILED, start_watchdog

__all__ = [
    "EXIT_HUNG",
    "EXIT_PEER_FAILED",
    "DataLoaderRestartError",
    "PeerFailedError",
    "RestartableDataLoader",
    "WorkerRestart",
    "fail_together",
    "latest_checkpoint",
    "make_restartable",
    "one_rank_first",
    "start_watchdog",
]
__version__ = "0.1.0"

_compat_torchrun.install()  # under torchrun: every attempt's process groups in their own store namespace
