"""Make distributed PyTorch training fail together instead of deadlocking.

Public names:

* :class:`fail_together`: a section that, if it raises on any rank, raises on every rank.
* :class:`one_rank_first`: exception-safe drop-in for ``ignite.distributed.one_rank_first``.
* :class:`PeerFailedError`: what the ranks that did not fail raise, naming the one that did.
* :class:`SectionMismatchError`: ranks met in different sections (a bug in the job).
* :class:`HangInterrupted`: what a hung rank's main thread is interrupted with while recovering in
  place (a ``BaseException``: an ``except Exception`` cannot swallow it).
* :class:`RecoveryError`: a recovery in place could not be made (the message says why).
* :class:`StateTransferError`: live state sent at a recovery arrived damaged or not at all, on every
  rank together (the recovery falls back to the newest checkpoint).
* ``EXIT_PEER_FAILED`` (87), ``EXIT_HUNG`` (88), ``EXIT_TEARDOWN_STUCK`` (89): the exit codes of a
  process the library ends (a released rank, a hung rank, a teardown that did not finish).
* :func:`start_watchdog`: the out-of-band watchdog (the adapters start it for you).
* :func:`writing_checkpoint`: mark a checkpoint write that a reported exit must wait for.
* :class:`deferred_interrupt`: a section the interrupt of a hung rank (recovering in place) waits outside.
* :class:`RestartableDataLoader`, :func:`make_restartable`: a DataLoader that survives worker death;
  :class:`WorkerRestart` (one restart, in ``loader.restarts``), :class:`DataLoaderRestartError` (a
  worker lost with the ``max_restarts`` budget spent).
* :func:`latest_checkpoint`: the newest complete checkpoint in a folder or of a trainer, the same on every rank.
* :func:`load_checkpoint`: ``torch.load``, from this process's memory after a recovery in place.
* :func:`recover_in_place`: after a failure, the same processes re-form the group and train on.
* :func:`recovery_attempt`: how many times this process recovered in place.
* :func:`spares_left`: how many spare ranks are left (``recover_in_place(fn, spares=k)``).
* :func:`recovery_history`, :func:`on_recovery`: a recovery in place's moments (:class:`RecoveryInfo`:
  failure seen, recovery started, recovered), as a list or as they happen.
* :class:`DDPBucketLayout`: a DDP's bucket layout in the checkpoint: a resume exact at any world size.
* :class:`ShardedState`, :func:`load_dcp`: a sharded model's distributed checkpoint (``DCPSaver`` for Ignite).
"""

from .launchers import compat_torchrun as _compat_torchrun
from .adapters.sources import latest_checkpoint
from .data.snapshots import load_checkpoint
from .data.ddp_buckets import DDPBucketLayout
from .data.dcp import ShardedState, load_dcp
from .data.loader import DataLoaderRestartError, RestartableDataLoader, WorkerRestart, make_restartable
from .core.errors import HangInterrupted, RecoveryError, SectionMismatchError, StateTransferError
from .core.failure import PeerFailedError
from .core.interrupts import EXIT_TEARDOWN_STUCK, deferred_interrupt
from .core.recoveries import (RecoveryCause, RecoveryInfo, RecoveryMetrics, RecoveryPhase, on_recovery,
                              recovery_history)
from .core.sections import fail_together, one_rank_first
from .detect.watchdog import EXIT_HUNG, EXIT_PEER_FAILED, start_watchdog, writing_checkpoint
from .recover import recover_in_place, recovery_attempt, spares_left
from . import wiring as _wiring

__all__ = [
    "EXIT_HUNG", "EXIT_PEER_FAILED", "EXIT_TEARDOWN_STUCK", "DDPBucketLayout", "DataLoaderRestartError",
    "HangInterrupted", "PeerFailedError", "RecoveryCause", "RecoveryError", "RecoveryInfo", "RecoveryMetrics",
    "RecoveryPhase", "RestartableDataLoader", "SectionMismatchError", "ShardedState", "StateTransferError",
    "WorkerRestart", "deferred_interrupt", "fail_together", "latest_checkpoint", "load_checkpoint", "load_dcp",
    "make_restartable", "on_recovery", "one_rank_first", "recover_in_place", "recovery_attempt", "recovery_history",
    "spares_left", "start_watchdog", "writing_checkpoint",
]
__version__ = "0.1.0"

_compat_torchrun.install()  # under torchrun: every attempt's process groups in their own store namespace
_wiring.install()  # every layer's part at the core's hooks, in the order of one table
