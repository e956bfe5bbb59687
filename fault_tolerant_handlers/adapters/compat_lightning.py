"""Every use of Lightning's private API, in one place, checked when the callback is set up; checked
against lightning 2.5.0 and 2.6.6, and pytorch-lightning 2.6.6 (two copies with distinct classes:
each name is looked up in the namespace of the object given).

* ``strategies.launchers.multiprocessing._MultiProcessingLauncher`` (``ddp_spawn``: ``on_exception``
  runs in the parent only) and ``Trainer._run_stage``, wrapped in spawned ranks;
* ``Trainer._teardown``: the last step of Lightning's exception path, which the callback finishes;
* ``strategies.launchers.subprocess_script._SubprocessScriptLauncher`` (:func:`keep_launched_ranks`);
* ``Trainer._checkpoint_connector.dump_checkpoint`` (live state) and ``.resume_start``;
* ``loops.loop._Loop``, ``loops.progress._BaseProgress`` (:func:`loop_parts`);
* ``FitLoop._load_combined_loader_states``, ``._combined_loader`` (:func:`train_loaders`) and fabric's
  ``_set_sampler_epoch`` (:func:`set_sampler_epochs_first`); a checkpoint's ``loops`` (:func:`finish_epoch`);
* ``ModelParallelStrategy._save_distributed_checkpoint`` (:func:`dump_checkpoint`: no collective);
* ``ModelCheckpoint.__resolve_ckpt_dir``, mirrored by :func:`checkpoint_folders`;
* ``Trainer.callback_metrics`` is the logger connector's own dict (``LightningModule.log``'s first
  call costs 0.5-0.9 s at 4 ranks);
* ``<logger>._get_next_version`` and CSV's ``_ExperimentWriter`` (``metrics_file_path``,
  ``metrics_keys``, ``metrics``): the next attempt's loggers keep the first attempt's version and rows.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import operator
import os
import sys
from typing import Any, Callable

import torch

from ..core import interrupts
from ..core.errors import RecoveryError

CHECKED_AGAINST = ("2.5.0", "2.6.6")

def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


_import = importlib.import_module

#: The installed namespaces of Lightning's trainer, ``lightning.pytorch`` first.
NAMESPACES: tuple[str, ...] = tuple(
    name for name in ("lightning.pytorch", "pytorch_lightning") if _installed(name.split(".")[0])
)
_DISTRIBUTION = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch-lightning"}  # for errors


def namespace(obj: Any) -> str:
    """The package (``"lightning.pytorch"`` or ``"pytorch_lightning"``) of a trainer, strategy or loop."""
    return "pytorch_lightning" if type(obj).__module__.split(".")[0] == "pytorch_lightning" else "lightning.pytorch"


def callback_base(module: str) -> type:
    """The ``Callback`` class of the installed namespace (else an ``ImportError``); with ``lightning.pytorch``
    and ``pytorch_lightning`` both installed, a class of ``module`` that is a ``Callback`` of either."""
    bases, errors = [], []
    for name in NAMESPACES:
        try:
            bases.append(_import(name + ".callbacks").Callback)
        except Exception as err:  # noqa: BLE001 - a broken second install must not break the first
            errors.append(f"{name}: {type(err).__name__}: {err}")
    if not bases:
        raise ImportError("fault_tolerant_handlers.lightning needs Lightning: pip install "
                          "'fault-tolerant-handlers[lightning]' (or pytorch-lightning)"
                          + (f" ({'; '.join(errors)})" if errors else ""))
    return bases[0] if len(bases) == 1 else type("_CallbackBase", tuple(bases), {"__module__": module})


def checkpoint_types() -> tuple[type, ...]:
    """``Checkpoint`` (the base of ``ModelCheckpoint`` and ``OnExceptionCheckpoint``) of every imported namespace."""
    return tuple(sys.modules[name + ".callbacks"].Checkpoint for name in NAMESPACES
                 if hasattr(sys.modules.get(name + ".callbacks"), "Checkpoint"))


def check(trainer: Any) -> None:
    """Raise ``RuntimeError`` naming what this Lightning version lacks."""
    ns = namespace(trainer)
    missing = []
    try:
        _import(ns + ".strategies.launchers.multiprocessing")._MultiProcessingLauncher  # noqa: B018
    except (ImportError, AttributeError):
        missing.append(f"{ns}.strategies.launchers.multiprocessing._MultiProcessingLauncher")
    for name in ("_run_stage", "_teardown"):
        if not callable(getattr(trainer, name, None)):
            missing.append(f"{ns}.Trainer.{name}")
    if not callable(getattr(getattr(trainer, "fit_loop", None), "_load_combined_loader_states", None)):
        missing.append(f"{ns}.loops._FitLoop._load_combined_loader_states")
    strategy = getattr(trainer, "strategy", None)
    if strategy is not None and model_parallel(strategy) and not hasattr(strategy, "_save_distributed_checkpoint"):
        missing.append(f"{ns}.strategies.ModelParallelStrategy._save_distributed_checkpoint")
    if missing:
        version = getattr(_import(ns), "__version__", "?")
        raise RuntimeError(f"fault-tolerant-handlers needs {', '.join(missing)}, which {_DISTRIBUTION[ns]} "
                           f"{version} does not have (checked against {', '.join(CHECKED_AGAINST)})")


def on_exception_runs_in_rank(trainer: Any) -> bool:
    """False for ``ddp_spawn``/``ddp_fork``/``ddp_notebook``: ``on_exception`` runs in the parent."""
    launcher_type = _import(namespace(trainer) + ".strategies.launchers.multiprocessing")._MultiProcessingLauncher
    return not isinstance(trainer.strategy.launcher, launcher_type)


def wrap_run_stage(trainer: Any, wrapper: Callable[[Callable[[], Any]], Any]) -> None:
    original = trainer._run_stage
    if getattr(original, "_fth_wrapped", False):
        return

    @functools.wraps(original)
    def run_stage() -> Any:
        return wrapper(original)

    run_stage._fth_wrapped = True  # type: ignore[attr-defined]
    trainer._run_stage = run_stage  # type: ignore[method-assign]


def interrupt_steps(trainer: Any, exception: BaseException) -> list[tuple[str, Callable[[], Any]]]:
    """The rest of Lightning's ``_interrupt`` after the callbacks' ``on_exception``: datamodule and
    strategy ``on_exception``, ``logger.finalize("failed")``, ``Trainer._teardown``."""
    steps: list[tuple[str, Callable[[], Any]]] = []
    if trainer.datamodule is not None:
        steps.append(("datamodule.on_exception", lambda: trainer.datamodule.on_exception(exception)))
    steps.append(("strategy.on_exception", lambda: trainer.strategy.on_exception(exception)))
    for logger in trainer.loggers:
        steps.append((f"{type(logger).__name__}.finalize", functools.partial(logger.finalize, "failed")))
    steps.append(("Trainer._teardown", trainer._teardown))
    return steps


def keep_launched_ranks(trainer: Any) -> bool:
    """In the process that started the other ranks (``strategy="ddp"``): set ``LOCAL_RANK`` so that the
    next attempt's ``Trainer`` does not start them again (True: it had to); else a ``RecoveryError``."""
    ns = namespace(trainer)
    try:
        launcher_type = _import(ns + ".strategies.launchers.subprocess_script")._SubprocessScriptLauncher
    except (ImportError, AttributeError):
        version = getattr(_import(ns), "__version__", "?")
        raise RecoveryError(
            f"recover_in_place under Lightning needs {ns}.strategies.launchers.subprocess_script."
            f"_SubprocessScriptLauncher, which {_DISTRIBUTION[ns]} {version} does not have (checked against {', '.join(CHECKED_AGAINST)}); "
            "launch the ranks with torchrun instead") from None
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if not isinstance(trainer.strategy.launcher, launcher_type) or environment is None \
            or environment.creates_processes_externally:
        return False
    os.environ["LOCAL_RANK"] = str(environment.local_rank())
    if not environment.creates_processes_externally:
        raise RecoveryError(
            f"recover_in_place with strategy='ddp': the cluster environment {type(environment).__name__} would start "
            "the other ranks again in the next attempt (its creates_processes_externally stays False once they were "
            "started); launch the ranks with torchrun instead")
    return True


def keep_checkpoints_in_memory(strategy: Any, keep: Callable[[Any, Any], Any] | None,
                               newest: Callable[[Any], Any]) -> None:
    """Once per strategy: ``save_checkpoint`` also calls ``keep(filepath, checkpoint)`` (unless ``None``),
    ``load_checkpoint(path)`` returns ``newest(path)`` if not ``None``."""
    if getattr(strategy, "_fth_snapshots", False):
        return
    save, load = strategy.save_checkpoint, strategy.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(checkpoint: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        with interrupts.SECTION:  # the interrupt of a hung main thread waits until the file is written
            result = save(checkpoint, filepath, *args, **kwargs)
            keep(filepath, checkpoint)
        return result

    @functools.wraps(load)
    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        kept = newest(checkpoint_path)
        return kept if kept is not None else load(checkpoint_path, *args, **kwargs)

    if keep is not None:
        strategy.save_checkpoint = save_checkpoint
    strategy.load_checkpoint = load_checkpoint
    strategy._fth_snapshots = True


def restores_itself(strategy: Any) -> str:
    """Why a checkpoint dict handed to ``strategy`` would not be what it loads ("" when it is)."""
    ns = namespace(strategy)
    base = _import(ns + ".strategies").Strategy
    overridden = [name for name in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict")
                  if getattr(type(strategy), name, None) is not getattr(base, name)]
    if not overridden:
        return ""
    return (f"the strategy {type(strategy).__name__} restores the weights and optimizer in its own load_checkpoint "
            f"({', '.join(overridden)} overridden): fit(ckpt_path=...) reads the checkpoint where it was written")


def plain_ddp(strategy: Any) -> bool:
    """``strategy`` is a plain ``DDPStrategy``: its checkpoint dict is built without collectives."""
    strategies = _import(namespace(strategy) + ".strategies")
    deepspeed = getattr(strategies, "DeepSpeedStrategy", ())
    return isinstance(strategy, strategies.DDPStrategy) and not isinstance(strategy, deepspeed)


def model_parallel(strategy: Any) -> bool:
    return isinstance(strategy, getattr(_import(namespace(strategy) + ".strategies"), "ModelParallelStrategy", ()))


def dump_checkpoint(trainer: Any) -> dict:
    """The dict ``trainer.save_checkpoint(path)`` would write (no barrier, no file); under a
    ``ModelParallelStrategy``, each rank's own shards (its one-file form gathers them with collectives)."""
    strategy = trainer.strategy
    gathers = model_parallel(strategy) and not strategy._save_distributed_checkpoint
    if gathers:
        strategy._save_distributed_checkpoint = True
    try:
        return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    finally:
        if gathers:
            strategy._save_distributed_checkpoint = False


def train_loaders(trainer: Any) -> list:
    """The fit's training loaders (set up before ``on_train_start``), or ``[]``."""
    return list(getattr(getattr(trainer.fit_loop, "_combined_loader", None), "flattened", ()))


def set_sampler_epochs_first(fit_loop: Any) -> None:
    """The training loaders' samplers get the epoch before ``FitLoop.setup_data`` creates their iterator
    (Lightning 2.5.3 to 2.6.6 at least, issue 21938: a DataLoader with workers draws its indices as its
    iterator is made, so the first epoch resumed from a checkpoint took epoch 0's order; PR 21941's fix)."""
    original = fit_loop._load_combined_loader_states
    if getattr(original, "_fth_wrapped", False):
        return
    fabric = "lightning_fabric" if namespace(fit_loop) == "pytorch_lightning" else "lightning.fabric"
    set_epoch = _import(fabric + ".utilities.data")._set_sampler_epoch

    @functools.wraps(original)
    def load_states() -> None:
        original()
        for loader in fit_loop._combined_loader.flattened:
            set_epoch(loader, fit_loop.epoch_progress.current.processed)

    load_states._fth_wrapped = True  # type: ignore[attr-defined]
    fit_loop._load_combined_loader_states = load_states


def finish_epoch(loops: Any) -> bool:
    """A fit loop's state saved in ``on_train_batch_end`` of an epoch's last batch (a step-interval
    ``ModelCheckpoint``, live state) counts that batch ``completed`` one short and the epoch not
    ``processed``: Lightning (checked against 2.6.6; issue 19815) resumes it by counting the epoch done
    within the next one, which then starts without ``on_train_epoch_start``, draws the first resumed
    epoch in the finished epoch's sampler order, and keeps its epoch counters one behind for good (a
    later checkpoint then skips an epoch). Counted in, in place, as a checkpoint saved at the epoch's end
    (``on_train_epoch_end``) has them: the next epoch runs whole. True if ``loops`` was so."""
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    try:
        epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
        e, b = epochs["total"], batches["total"]
        short = (batches["is_last_batch"] is True and b["ready"] == b["started"] == b["processed"] == b["completed"] + 1
                 and e["ready"] == e["started"] == e["processed"] + 1 and e["completed"] == e["processed"])
    except (KeyError, TypeError):  # another version's layout: left to Lightning
        return False
    if not short:
        return False
    for progress in (batches["total"], batches["current"]):
        progress["completed"] += 1
    for progress in (epochs["total"], epochs["current"]):
        progress["processed"] += 1
    loop_state = fit.get("epoch_loop.state_dict")
    if isinstance(loop_state, dict) and isinstance(loop_state.get("_batches_that_stepped"), int):
        loop_state["_batches_that_stepped"] += 1  # counted after the batch's end, as at the epoch's end
    return True


def _nodes(progress: Any) -> list:
    found = [progress]
    for value in progress.__dict__.values():
        if dataclasses.is_dataclass(value):
            found += _nodes(value)
    return found


def loop_parts(loop: Any) -> tuple[list, list]:
    """``([(key, loop)], [(key, progress, [(node, fields, getter)])])``: every loop and progress object
    under ``loop``, keyed as ``loop.state_dict()`` keys them (copied cheaply at every batch)."""
    ns = namespace(loop)
    loop_type = _import(ns + ".loops.loop")._Loop
    progress_type = _import(ns + ".loops.progress")._BaseProgress
    loops: list = []
    progresses: list = []

    def walk(node: Any, prefix: str) -> None:
        loops.append((prefix + "state_dict", node))
        for key, value in node.__dict__.items():
            if isinstance(value, progress_type):
                plain = []
                for part in _nodes(value):
                    fields = tuple(k for k, v in part.__dict__.items() if not dataclasses.is_dataclass(v))
                    plain.append((part, fields, operator.itemgetter(*fields) if fields else None))
                progresses.append((prefix + key, value, plain))
            elif isinstance(value, loop_type):
                walk(value, prefix + key + ".")

    walk(loop, "")
    return loops, progresses


def snapshot_loops(parts: tuple[list, list]) -> tuple[list, list]:
    """The loops' state now, cheaply (:func:`loop_state` builds the dict later)."""
    loops, progresses = parts
    return ([(key, node.on_save_checkpoint()) for key, node in loops],
            [getter(part.__dict__) for _, _, plain in progresses for part, _, getter in plain if getter is not None])


def _clone(obj: Any) -> Any:
    new = object.__new__(type(obj))
    for key, value in obj.__dict__.items():
        new.__dict__[key] = _clone(value) if dataclasses.is_dataclass(value) else value
    return new


def loop_state(parts: tuple[list, list], snapshot: tuple[list, list]) -> dict:
    """What ``loop.state_dict()`` returned when :func:`snapshot_loops` took ``snapshot``."""
    saved, values = snapshot
    state = dict(saved)
    taken = iter(values)
    for key, progress, plain in parts[1]:
        copy = _clone(progress)
        for (_, fields, getter), node in zip(plain, _nodes(copy)):
            if getter is not None:
                value = next(taken)
                node.__dict__.update(zip(fields, value if len(fields) > 1 else (value,)))
        state[key] = copy.state_dict()
    return state


#: What ``fit(ckpt_path=...)`` needs of a checkpoint beyond the weights (Lightning 2.5-2.6,
#: ``_CheckpointConnector.restore_optimizers_and_schedulers``: a ``KeyError`` without it): a weights-only file lacks it.
RESUME_KEYS = ("optimizer_states",)


def finished_fit(path: str, trainer: Any) -> str | None:
    """What says the fit saved at ``path`` is over for ``trainer`` (Lightning 2.5-2.6, ``_FitLoop.done``:
    ``global_step`` at ``max_steps``, or the epochs ``processed`` at ``max_epochs``), else ``None``; a
    directory, or a file ``weights_only`` does not load, is not judged."""
    if os.path.isdir(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        step = saved.get("global_step")
        epochs = saved["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]
    except Exception:  # noqa: BLE001 - not judged
        return None
    max_steps, max_epochs = getattr(trainer, "max_steps", -1), getattr(trainer, "max_epochs", None)
    if isinstance(step, int) and isinstance(max_steps, int) and max_steps >= 0 and step >= max_steps:
        return f"its global step {step} reached max_steps={max_steps}"
    if isinstance(epochs, int) and isinstance(max_epochs, int) and max_epochs >= 0 and epochs >= max_epochs:
        return f"its {epochs} epoch{'s' * (epochs != 1)} reached max_epochs={max_epochs}"
    return None


def checkpoint_folders(trainer: Any) -> tuple[list[str], str]:
    """The folders the trainer's ``ModelCheckpoint`` writes to (and wrote to in earlier runs) and a label:
    its ``dirpath``, else the ``checkpoints`` folder of every version of the first logger (its
    ``version`` is not read: that would fix it on each rank), or ``<default_root_dir>/checkpoints``."""
    callback = getattr(trainer, "checkpoint_callback", None)
    if callback is None:
        raise ValueError("latest_checkpoint(trainer): the trainer has no ModelCheckpoint (enable_checkpointing=False "
                         "and none in its callbacks): nothing writes checkpoints to resume from")
    if callback.dirpath is not None:
        folder = os.path.abspath(os.fspath(callback.dirpath))
        return [folder], folder
    loggers = list(trainer.loggers)
    if not loggers:
        folder = os.path.abspath(os.path.join(trainer.default_root_dir, "checkpoints"))
        return [folder], folder
    logger = loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    root = os.path.abspath(os.path.join(save_dir, str(logger.name)))
    versions = []
    if os.path.isdir(root):
        versions = sorted(os.path.join(root, entry, "checkpoints") for entry in os.listdir(root)
                          if os.path.isdir(os.path.join(root, entry, "checkpoints")))
    return versions or [root], os.path.join(root, "*", "checkpoints")


def put_callback_metrics(trainer: Any, values: dict[str, float]) -> bool:
    """Put ``values`` into ``trainer.callback_metrics``; ``False`` when it does not keep them (a copy)."""
    metrics = trainer.callback_metrics
    for name, value in values.items():
        metrics[name] = torch.tensor(float(value))
    kept = trainer.callback_metrics
    return all(name in kept for name in values)


def substitute_ckpt_path(trainer: Any, substitute: Callable[[Any], Any]) -> None:
    """``fit`` on this trainer loads ``substitute(ckpt_path)`` instead of ``ckpt_path`` when not ``None``."""
    connector = trainer._checkpoint_connector
    original = connector.resume_start
    if getattr(original, "_fth_substitute", False):
        return

    @functools.wraps(original)
    def resume_start(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(trainer, "state", None), "fn", None) == "fit":
            checkpoint_path = substitute(checkpoint_path) or checkpoint_path
        return original(checkpoint_path, *args, **kwargs)

    resume_start._fth_substitute = True  # type: ignore[attr-defined]
    connector.resume_start = resume_start


def logger_versions(trainer: Any) -> list[tuple[type, str, Any, str]]:
    """``(class, root folder, version, folder)`` of each logger that numbers its versions (CSV, TensorBoard)."""
    return [(type(logger), str(logger.root_dir), logger.version, str(logger.log_dir)) for logger in trainer.loggers
            if callable(getattr(logger, "_get_next_version", None)) and getattr(logger, "root_dir", None) is not None]


def logger_class(ns: str, name: str) -> type | None:
    """The numbered logger class ``name`` of ``<ns>.loggers`` (``ns`` one of :data:`NAMESPACES`), else ``None``."""
    if ns not in NAMESPACES or not name.isidentifier():
        return None
    cls = getattr(_import(ns + ".loggers"), name, None)
    return cls if isinstance(cls, type) and callable(getattr(cls, "_get_next_version", None)) else None


def pin_next_versions(versions: list[tuple[type, str, Any, str]]) -> None:
    """A logger of a class in ``versions`` (:func:`logger_versions`' tuples, read as each logger numbers
    itself: emptied, nothing is pinned) takes the version kept for its root folder, not the next ``version_N``."""
    for cls in {cls for cls, *_ in versions}:  # each class once
        original = cls.__dict__.get("_fth_original_next_version") or getattr(cls, "_get_next_version")
        if getattr(cls.__dict__.get("_get_next_version"), "_fth_pinned", False):
            continue

        def _get_next_version(self: Any, _original: Any = original) -> Any:
            kept = next((v for c, root, v, _ in versions if type(self) is c
                         and str(getattr(self, "root_dir", "")) == root), None)
            return kept if kept is not None else _original(self)

        _get_next_version._fth_pinned = True  # type: ignore[attr-defined]
        cls._fth_original_next_version = original
        cls._get_next_version = _get_next_version


def restore_csv_metrics(trainer: Any, kept: dict[str, bytes]) -> list[str]:
    """On rank 0: a ``CSVLogger`` opened again in a folder of ``kept`` (its writer deleted ``metrics.csv``)
    gets the rows back before it writes any. Returns the folders restored."""
    restored = []
    if trainer.global_rank != 0:
        return restored
    for logger in trainer.loggers:
        writer = getattr(logger, "_experiment", None)
        path = getattr(writer, "metrics_file_path", None)
        data = kept.get(str(getattr(writer, "log_dir", "")))
        if not data or path is None or os.path.isfile(path) or getattr(writer, "metrics", None):
            continue
        with open(path, "wb") as f:
            f.write(data)
        header = data.decode("utf-8", "replace").splitlines()[:1]
        if header and hasattr(writer, "metrics_keys"):
            writer.metrics_keys = sorted(k for k in header[0].split(",") if k)
        restored.append(str(writer.log_dir))
    return restored
