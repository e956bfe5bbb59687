"""The restartable DataLoader (:mod:`.loader` and its private modules) and checkpoint discovery
(:mod:`.checkpoints`). They stand on :mod:`..core` only."""
