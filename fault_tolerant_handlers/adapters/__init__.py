"""What the Ignite and Lightning adapters share (:mod:`.guard`), and the private APIs of Ignite and
Lightning they use, each checked at start (:mod:`.compat_ignite`, :mod:`.compat_lightning`)."""

from ..core import events
from ..data import live
from . import compat_ignite


def _resolve_live_names(attempt: int) -> None:
    """The next attempt may carry on from live state: Ignite's ``Checkpoint.load_objects(to_load, path)``
    resolves the name ``latest_checkpoint`` gives for it."""
    if live.held() is not None:
        compat_ignite.resolve_live_names(live.take)


#: The adapters' answer to the core's events: a framework's process-wide state after a failed attempt.
events.subscribe(events.ATTEMPT_ENDED, compat_ignite.reset_idist)
events.subscribe(events.ATTEMPT_ENDED, _resolve_live_names)
