"""What the Ignite and Lightning adapters share (:mod:`.guard`), and the private APIs of Ignite and
Lightning they use, each checked at start (:mod:`.compat_ignite`, :mod:`.compat_lightning`)."""

from ..core.phases import RecoveryState
from ..data import live
from . import compat_ignite


def _reset_idist(state: RecoveryState) -> None:
    compat_ignite.reset_idist()


def _resolve_live_names(state: RecoveryState) -> None:
    """The next attempt may carry on from live state: Ignite's ``Checkpoint.load_objects(to_load, path)``
    resolves the name ``latest_checkpoint`` gives for it."""
    if live.held() is not None:
        compat_ignite.hook_load_objects(take=live.take)
