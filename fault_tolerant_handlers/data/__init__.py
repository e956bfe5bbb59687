"""The restartable DataLoader (:mod:`.loader` and its private modules) and checkpoint discovery
(:mod:`.checkpoints`). They stand on :mod:`..core` only. What the data layer does in a recovery in
place (:mod:`.recovery`) is registered here, at import."""

from ..core import phases
from . import recovery

for _phase, _step in recovery.STEPS:
    phases.register(_phase, _step)
