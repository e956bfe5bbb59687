"""The restartable DataLoader (:mod:`.loader` and its private modules) and checkpoint discovery
(:mod:`.checkpoints`). They stand on :mod:`..core` only. What the data layer does in a recovery in
place (:mod:`.recovery`) is wired in :mod:`..wiring`."""
