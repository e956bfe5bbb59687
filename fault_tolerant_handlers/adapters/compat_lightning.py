"""Every use of Lightning's private API, in one place, checked when the callback is set up.

Checked against lightning 2.6.6.

* ``lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher``: the launcher of
  ``ddp_spawn``/``ddp_fork``/``ddp_notebook``, which runs the stage in the ranks without
  ``_call_and_handle_interrupt`` (so ``on_exception`` runs in the parent only);
* ``Trainer._run_stage``: wrapped in spawned ranks, to give them an exception path;
* ``Trainer._teardown``: the last step of Lightning's exception path (``trainer.call._interrupt``),
  which the callback finishes itself.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

CHECKED_AGAINST = ("2.6.6",)


def check(trainer: Any) -> None:
    """Raise ``RuntimeError`` naming what this Lightning version lacks."""
    missing = []
    try:
        from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher  # noqa: F401
    except ImportError:
        missing.append("lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher")
    for name in ("_run_stage", "_teardown"):
        if not callable(getattr(trainer, name, None)):
            missing.append(f"lightning.pytorch.Trainer.{name}")
    if missing:
        import lightning

        raise RuntimeError(f"fault-tolerant-handlers needs {', '.join(missing)}, which lightning "
                           f"{lightning.__version__} does not have (checked against {', '.join(CHECKED_AGAINST)})")


def on_exception_runs_in_rank(trainer: Any) -> bool:
    """False for ``ddp_spawn``/``ddp_fork``/``ddp_notebook``: ``on_exception`` runs in the parent."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return not isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)


def wrap_run_stage(trainer: Any, wrapper: Callable[[Callable[[], Any]], Any]) -> None:
    """Run ``wrapper(original)`` instead of ``Trainer._run_stage`` on this trainer object (in a
    spawned rank: the rank's own copy)."""
    original = trainer._run_stage
    if getattr(original, "_fth_wrapped", False):
        return

    @functools.wraps(original)
    def run_stage() -> Any:
        return wrapper(original)

    run_stage._fth_wrapped = True  # type: ignore[attr-defined]
    trainer._run_stage = run_stage  # type: ignore[method-assign]


def interrupt_steps(trainer: Any, exception: BaseException) -> list[tuple[str, Callable[[], Any]]]:
    """The rest of ``lightning.pytorch.trainer.call._interrupt`` after the callbacks' ``on_exception``,
    and of the ``except BaseException`` branch of ``_call_and_handle_interrupt``: datamodule
    ``on_exception``, ``strategy.on_exception``, ``logger.finalize("failed")``, ``Trainer._teardown``."""
    steps: list[tuple[str, Callable[[], Any]]] = []
    if trainer.datamodule is not None:
        steps.append(("datamodule.on_exception", lambda: trainer.datamodule.on_exception(exception)))
    steps.append(("strategy.on_exception", lambda: trainer.strategy.on_exception(exception)))
    for logger in trainer.loggers:
        steps.append((f"{type(logger).__name__}.finalize", functools.partial(logger.finalize, "failed")))
    steps.append(("Trainer._teardown", trainer._teardown))
    return steps
