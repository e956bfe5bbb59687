"""Public path of the restartable DataLoader (defined in :mod:`.data.loader`)."""

from .data.loader import DataLoaderRestartError, RestartableDataLoader, WorkerRestart, make_restartable

__all__ = ["DataLoaderRestartError", "RestartableDataLoader", "WorkerRestart", "make_restartable"]
