"""The restartable DataLoader (:mod:`.loader` and its private modules) and checkpoint discovery
(:mod:`.checkpoints`). They stand on :mod:`..core` only. What the data layer does in a recovery in
place (:mod:`.recovery`) is registered here, at import."""

from ..core import hooks
from . import recovery

for _phase, _step in recovery.STEPS:
    hooks.add(_phase, _step)
