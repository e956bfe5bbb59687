"""What the Ignite and Lightning adapters share (:mod:`.guard`), and the private APIs of Ignite and
Lightning they use, each checked at start (:mod:`.compat_ignite`, :mod:`.compat_lightning`)."""
