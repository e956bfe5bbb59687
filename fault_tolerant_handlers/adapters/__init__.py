"""What the Ignite and Lightning adapters share (:mod:`.guard`), and the private APIs of Ignite and
Lightning they use, each checked at start (:mod:`.compat_ignite`, :mod:`.compat_lightning`)."""

from ..core import events
from . import compat_ignite

#: The adapters' answer to the core's events: a framework's process-wide state after a failed attempt.
events.subscribe(events.ATTEMPT_ENDED, compat_ignite.reset_idist)
