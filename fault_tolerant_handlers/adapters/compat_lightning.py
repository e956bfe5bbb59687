"""Every use of Lightning's private API, in one place, checked when the callback is set up.

Checked against lightning 2.5.0 and 2.6.6, and pytorch-lightning 2.6.6 (the standalone package).

Lightning ships under two names: ``lightning.pytorch`` (the ``lightning`` package) and
``pytorch_lightning`` (the ``pytorch-lightning`` package), two copies of the same code whose classes
are distinct. :data:`NAMESPACES` lists those installed; the callback derives from the ``Callback`` of
each (:func:`callback_bases`), and each private name below is looked up in the namespace of the
trainer it is given (:func:`namespace`).

* ``<namespace>.strategies.launchers.multiprocessing._MultiProcessingLauncher``: the launcher of
  ``ddp_spawn``/``ddp_fork``/``ddp_notebook``, which runs the stage in the ranks without
  ``_call_and_handle_interrupt`` (so ``on_exception`` runs in the parent only);
* ``Trainer._run_stage``: wrapped in spawned ranks, to give them an exception path;
* ``Trainer._teardown``: the last step of Lightning's exception path (``trainer.call._interrupt``),
  which the callback finishes itself;
* ``<namespace>.strategies.launchers.subprocess_script._SubprocessScriptLauncher``: the launcher of
  ``strategy="ddp"``, whose ``_call_children_scripts`` sets ``LOCAL_RANK`` in the environment of the
  process that started the other ranks; recovering in place relies on it (:func:`keep_launched_ranks`,
  looked up only then).
* ``Trainer._checkpoint_connector.dump_checkpoint(weights_only=False)``: the dict
  ``trainer.save_checkpoint`` writes, without its barrier and file (live state, :func:`dump_checkpoint`);
* ``<namespace>.loops.loop._Loop`` and ``<namespace>.loops.progress._BaseProgress``: the loops' state as
  ``_Loop.state_dict`` walks it (``on_save_checkpoint()`` of each loop, the progress objects in its
  ``__dict__``), copied cheaply at every completed batch (:func:`loop_parts`, :func:`snapshot_loops`);
* ``<namespace>.strategies.DDPStrategy`` / ``DeepSpeedStrategy``: live state only under a plain DDP
  strategy, whose checkpoint is built without collectives (:func:`plain_ddp`).
* ``ModelCheckpoint.__resolve_ckpt_dir`` (name-mangled, called in its ``setup``): where a
  ``ModelCheckpoint`` without ``dirpath`` writes, mirrored (not called) by :func:`checkpoint_folders`
  for ``latest_checkpoint(trainer)`` before ``fit``: ``<logger save_dir or default_root_dir>/<logger
  name>/<version>/checkpoints``, or ``<default_root_dir>/checkpoints`` without a logger.
* ``Trainer.callback_metrics`` (public) returns the logger connector's own dict, which keeps what is
  put in it until the next stage resets it: the recovery's numbers go there directly
  (:func:`put_callback_metrics`), not through ``LightningModule.log``, whose first call in a process
  costs 0.5-0.9 s at 4 ranks on 2 loaded cores (its result collection's ``apply_to_collection``
  meeting each type for the first time: ABC subclass checks over every class torch defines), paid at
  the first batch after the first recovery.
* ``Trainer._checkpoint_connector.resume_start(checkpoint_path, ...)``: where ``fit`` loads the
  ``ckpt_path`` it was given (``None``: nothing); recovering in place with live state held, the path
  is replaced by the live state's name, whatever the script passed (:func:`substitute_ckpt_path`).
* ``<logger class>._get_next_version`` (``CSVLogger``, ``TensorBoardLogger``: the version a logger
  takes when none is given, from the folders that exist) and CSV's ``_ExperimentWriter`` (its
  ``metrics_file_path``, ``metrics_keys``, ``metrics``; it deletes ``metrics.csv`` of a folder it opens):
  recovering in place, the next attempt's loggers keep the first attempt's version and rows
  (:func:`pin_next_versions`, :func:`restore_csv_metrics`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

from ..core import interrupts

CHECKED_AGAINST = ("2.5.0", "2.6.6")

def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


#: The installed namespaces of Lightning's trainer, ``lightning.pytorch`` first.
NAMESPACES: tuple[str, ...] = tuple(
    name for name in ("lightning.pytorch", "pytorch_lightning") if _installed(name.split(".")[0])
)
#: The distribution that provides each namespace (for error messages).
_DISTRIBUTION = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch-lightning"}


def _import(name: str) -> Any:
    return importlib.import_module(name)


def namespace(trainer: Any) -> str:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``: the package whose ``Trainer`` this is."""
    module = type(trainer).__module__
    return "pytorch_lightning" if module.split(".")[0] == "pytorch_lightning" else "lightning.pytorch"


def callback_bases() -> tuple[type, ...]:
    """The ``Callback`` class of every installed namespace: the callback derives from each, so that
    a ``Trainer`` of either takes it as its own (Lightning checks ``isinstance(cb, Callback)`` in
    places, e.g. ``is_overridden`` without a parent in lightning 2.5). The ``lightning`` package
    depends on ``pytorch-lightning``, so both are usually installed, and both are imported here
    (the second costs a fraction of a second of import per rank). A namespace that is installed
    but does not import is left out; none at all is an ``ImportError`` saying what to install."""
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
    return tuple(bases)


def checkpoint_types() -> tuple[type, ...]:
    """``Checkpoint`` (the base of ``ModelCheckpoint`` and ``OnExceptionCheckpoint``) of every
    namespace imported by now (a trainer's callbacks come from imported namespaces)."""
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
    if missing:
        version = getattr(_import(ns), "__version__", "?")
        raise RuntimeError(f"fault-tolerant-handlers needs {', '.join(missing)}, which {_DISTRIBUTION[ns]} "
                           f"{version} does not have (checked against {', '.join(CHECKED_AGAINST)})")


def on_exception_runs_in_rank(trainer: Any) -> bool:
    """False for ``ddp_spawn``/``ddp_fork``/``ddp_notebook``: ``on_exception`` runs in the parent."""
    launcher_type = _import(namespace(trainer) + ".strategies.launchers.multiprocessing")._MultiProcessingLauncher
    return not isinstance(trainer.strategy.launcher, launcher_type)


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


def keep_launched_ranks(trainer: Any) -> bool:
    """In the process of a ``strategy="ddp"`` run that started the other ranks (rank 0, Lightning's
    ``_SubprocessScriptLauncher``), recovering in place: make sure the ``Trainer`` of the next attempt
    does not start them again. Lightning's environment starts them unless it ``creates_processes_externally``,
    which ``LightningEnvironment`` reads from ``LOCAL_RANK``; ``_call_children_scripts`` sets that variable
    in this process itself (lightning 2.5.0, 2.6.6), and this sets it where a version would not. Returns
    True if it had to. Raises ``RuntimeError`` when the launcher is missing or the cluster environment
    would start the ranks again anyway."""
    ns = namespace(trainer)
    try:
        launcher_type = _import(ns + ".strategies.launchers.subprocess_script")._SubprocessScriptLauncher
    except (ImportError, AttributeError):
        version = getattr(_import(ns), "__version__", "?")
        raise RuntimeError(
            f"recover_in_place under Lightning needs {ns}.strategies.launchers.subprocess_script."
            f"_SubprocessScriptLauncher, which {_DISTRIBUTION[ns]} {version} does not have (checked against {', '.join(CHECKED_AGAINST)}); "
            "launch the ranks with torchrun instead") from None
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if not isinstance(trainer.strategy.launcher, launcher_type) or environment is None \
            or environment.creates_processes_externally:
        return False
    os.environ["LOCAL_RANK"] = str(environment.local_rank())
    if not environment.creates_processes_externally:
        raise RuntimeError(
            f"recover_in_place with strategy='ddp': the cluster environment {type(environment).__name__} would start "
            "the other ranks again in the next attempt (its creates_processes_externally stays False once they were "
            "started); launch the ranks with torchrun instead")
    return True


def keep_checkpoints_in_memory(strategy: Any, keep: Callable[[Any, Any], Any], newest: Callable[[Any], Any]) -> None:
    """Recovering in place: ``Strategy.save_checkpoint(checkpoint, filepath, ...)`` (public, called on
    every rank; it writes on rank 0) also calls ``keep(filepath, checkpoint)``, and
    ``Strategy.load_checkpoint(path, ...)`` returns ``newest(path)`` when that is not ``None``
    (:mod:`..data.snapshots`). The save is a deferred section (:mod:`..core.interrupts`). On this
    strategy object only; once."""
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

    strategy.save_checkpoint = save_checkpoint
    strategy.load_checkpoint = load_checkpoint
    strategy._fth_snapshots = True


def restores_itself(strategy: Any) -> str:
    """Why a checkpoint dict handed to ``strategy`` would not be what it loads ("" when it is).

    Lightning's ``Strategy.load_checkpoint`` reads the file and ``load_model_state_dict`` /
    ``load_optimizer_state_dict`` apply the dict it returned. ``ModelParallelStrategy``,
    ``FSDPStrategy`` (and DeepSpeed) load the weights and the optimizer inside their own
    ``load_checkpoint`` and make those two methods no-ops (checked against Lightning 2.5.0, 2.6.6):
    a dict returned instead of the file's is never applied."""
    ns = "pytorch_lightning" if type(strategy).__module__.split(".")[0] == "pytorch_lightning" else "lightning.pytorch"
    base = _import(ns + ".strategies").Strategy
    overridden = [name for name in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict")
                  if getattr(type(strategy), name, None) is not getattr(base, name)]
    if not overridden:
        return ""
    return (f"the strategy {type(strategy).__name__} restores the weights and optimizer in its own load_checkpoint "
            f"({', '.join(overridden)} overridden): fit(ckpt_path=...) reads the checkpoint where it was written")


def plain_ddp(strategy: Any) -> bool:
    """``strategy`` is Lightning's ``DDPStrategy`` (not DeepSpeed, FSDP...): its checkpoint dict is
    built from this rank's objects alone, without collectives."""
    ns = "pytorch_lightning" if type(strategy).__module__.split(".")[0] == "pytorch_lightning" else "lightning.pytorch"
    strategies = _import(ns + ".strategies")
    deepspeed = getattr(strategies, "DeepSpeedStrategy", ())
    return isinstance(strategy, strategies.DDPStrategy) and not isinstance(strategy, deepspeed)


def dump_checkpoint(trainer: Any) -> dict:
    """The dict ``trainer.save_checkpoint(path)`` would write (no barrier, no file)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def _nodes(progress: Any) -> list:
    """``progress`` and the progress objects inside it (trackers), depth first."""
    found = [progress]
    for value in progress.__dict__.values():
        if dataclasses.is_dataclass(value):
            found += _nodes(value)
    return found


def loop_parts(loop: Any) -> tuple[list, list]:
    """``([(key, loop)], [(key, progress, [(node, fields, getter)])])``: every loop under ``loop`` and
    every progress object, keyed as ``loop.state_dict()`` keys them, with a getter of the plain fields
    of each of its nodes (the structure is fixed once the trainer is set up)."""
    import operator

    ns = "pytorch_lightning" if type(loop).__module__.split(".")[0] == "pytorch_lightning" else "lightning.pytorch"
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
    """The loops' state now, cheaply (``loop.state_dict()`` turns every progress object into a dict
    with ``dataclasses.asdict``, tens of microseconds; here only their plain fields are read, and
    :func:`loop_state` builds the dict when it is needed)."""
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


def checkpoint_folders(trainer: Any) -> tuple[list[str], str]:
    """The folders the trainer's ``ModelCheckpoint`` writes to, and in earlier runs wrote to, and a
    label naming them: its ``dirpath`` when set; else, as Lightning resolves it at setup (mirroring
    ``ModelCheckpoint.__resolve_ckpt_dir``), the ``checkpoints`` folder of every version of the first
    logger (``lightning_logs/version_<n>``: each run, and each ``fit`` in the same process, opens a new
    version, so the newest checkpoint is usually in an earlier version's folder), or
    ``<default_root_dir>/checkpoints`` without a logger. The logger's ``version`` is not read: reading
    it fixes it before ``fit`` would, differently on each rank."""
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
    """Put ``values`` (as 0-d float tensors) into ``trainer.callback_metrics``; ``False`` when this
    Lightning's ``callback_metrics`` does not keep them (a copy): the caller then logs them."""
    import torch

    metrics = trainer.callback_metrics
    for name, value in values.items():
        metrics[name] = torch.tensor(float(value))
    kept = trainer.callback_metrics
    return all(name in kept for name in values)


def substitute_ckpt_path(trainer: Any, substitute: Callable[[Any], Any]) -> None:
    """``fit`` on this trainer loads ``substitute(ckpt_path)`` instead of ``ckpt_path`` when that is not
    ``None`` (``Trainer._checkpoint_connector.resume_start``, lightning 2.5.0, 2.6.6). Once per trainer."""
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
    """``(class, root folder, version, folder)`` of each logger of ``trainer`` that numbers its versions
    (``_get_next_version``: ``CSVLogger``, ``TensorBoardLogger``)."""
    found = []
    for logger in trainer.loggers:
        if callable(getattr(logger, "_get_next_version", None)) and getattr(logger, "root_dir", None) is not None:
            found.append((type(logger), str(logger.root_dir), logger.version, str(logger.log_dir)))
    return found


def pin_next_versions(classes: Any, pinned: Callable[[Any], Any]) -> None:
    """A logger of one of ``classes`` whose version is not given takes ``pinned(logger)`` when that is
    not ``None``, instead of the next free ``version_N`` (``_get_next_version``, lightning 2.5.0,
    2.6.6). Each class once; ``pinned`` is asked every time (``None``: the next free one, as before)."""
    for cls in classes:
        original = cls.__dict__.get("_fth_original_next_version") or getattr(cls, "_get_next_version")
        if getattr(cls.__dict__.get("_get_next_version"), "_fth_pinned", False):
            continue

        def _get_next_version(self: Any, _original: Any = original) -> Any:
            version = pinned(self)
            return version if version is not None else _original(self)

        _get_next_version._fth_pinned = True  # type: ignore[attr-defined]
        cls._fth_original_next_version = original
        cls._get_next_version = _get_next_version


def restore_csv_metrics(trainer: Any, kept: dict[str, bytes]) -> list[str]:
    """On global rank 0: a ``CSVLogger`` opened again in a folder of ``kept`` (its writer deleted the
    folder's ``metrics.csv`` as it opened) gets the file's rows back, before it writes any, and appends
    to them. Returns the folders restored."""
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
