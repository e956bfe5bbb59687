"""The core: one fail-together session per process group and everything it stands on; it never imports
from a sibling folder and tells the other layers what happens through :mod:`.hooks`."""
