"""The restartable DataLoader (:mod:`.loader`), checkpoint discovery (:mod:`.checkpoints`) and what a
recovery in place keeps in memory (:mod:`.live`, :mod:`.snapshots`), on :mod:`..core` only; their
recovery steps are wired in :mod:`..wiring`."""
