"""Every use of PyTorch-Ignite's private API, in one place, checked when a handler is attached;
checked against pytorch-ignite 0.5.0.post2 and 0.5.5.

* ``Engine._event_handlers`` (``{event: [(func, args, kwargs)]}``; a filtered event's wrapper has
  ``_parent``, a weak reference to the handler);
* ``ignite.distributed.utils._model`` / ``_need_to_sync`` / ``_SerialModel`` (:func:`reset_idist`);
* ``Engine._process_function``: its closure and globals name the DDP that wraps a model;
* ``Engine._run_once_on_dataset_as_gen`` / ``_legacy`` (on the stack while an engine runs an epoch),
  and ``_internal_run_as_gen`` / ``_legacy``: the functions that log an exception at ERROR on
  ``Engine.logger`` right before ``Engine._handle_exception`` (:func:`run_codes`), which
  :func:`handle_exceptions` replaces for one engine.

What the failure path needs is resolved when the handler is attached: it calls nothing here.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Callable

CHECKED_AGAINST = ("0.5.0.post2", "0.5.5")


def _lacking(needs: str) -> RuntimeError:
    import ignite

    return RuntimeError(f"fault-tolerant-handlers {needs}, which pytorch-ignite {ignite.__version__} does not have "
                        f"(checked against {', '.join(CHECKED_AGAINST)})")


def check(engine: Any) -> None:
    if not isinstance(getattr(engine, "_event_handlers", None), dict):
        raise _lacking("needs ignite.engine.Engine._event_handlers (a dict of handler lists)")
    if not callable(getattr(engine, "_handle_exception", None)):
        raise _lacking("needs ignite.engine.Engine._handle_exception")


def prepend(engine: Any, event: Any, handler: Callable) -> None:
    engine.add_event_handler(event, handler)
    handlers = engine._event_handlers[event]
    handlers.insert(0, handlers.pop())


def append_last(engine: Any, event: Any, handler: Callable) -> None:
    handlers = engine._event_handlers[event]
    for i, entry in enumerate(handlers):
        if entry[0] == handler:
            handlers.append(handlers.pop(i))
            return


def attached_handlers(engine: Any) -> list:
    """Every handler attached to ``engine`` as it was given (a filtered event's unwrapped), each once."""
    found: list = []
    for entries in engine._event_handlers.values():
        for entry in entries:
            func = entry[0]
            parent = getattr(func, "_parent", None)
            if isinstance(parent, weakref.ref) and parent() is not None:
                func = parent()
            if all(func is not f for f in found):
                found.append(func)
    return found


#: Names of ``Engine`` methods that run an epoch (one of them is on the stack while an engine runs).
EPOCH_FUNCTIONS = ("_run_once_on_dataset_as_gen", "_run_once_on_dataset_legacy")
_ENGINE_FILE = f"ignite{os.sep}engine{os.sep}engine.py"


def check_running_engines() -> None:
    from ignite.engine import Engine

    if not any(callable(getattr(Engine, name, None)) for name in EPOCH_FUNCTIONS):
        raise _lacking(f"(hang_timeout='auto') needs ignite.engine.Engine.{EPOCH_FUNCTIONS[0]}")


def running_engines(frame: Any) -> list:
    """The engines running an epoch on the stack that ends in ``frame``, innermost first."""
    engines: list = []
    while frame is not None:
        code = frame.f_code
        if code.co_name in EPOCH_FUNCTIONS and code.co_filename.endswith(_ENGINE_FILE):
            engine = frame.f_locals.get("self")
            if engine is not None and all(engine is not e for e in engines):
                engines.append(engine)
        frame = frame.f_back
    return engines


#: Every ``Engine`` method that logs the exception it caught, then calls ``_handle_exception``.
RUN_FUNCTIONS = EPOCH_FUNCTIONS + ("_internal_run_as_gen", "_internal_run_legacy")


def run_codes() -> frozenset:
    """The code of every ``Engine`` method of :data:`RUN_FUNCTIONS`: the frame that catches an
    exception and logs it (its traceback's first) runs one of them."""
    from ignite.engine import Engine

    codes = frozenset(getattr(Engine, name).__code__ for name in RUN_FUNCTIONS if callable(getattr(Engine, name, None)))
    if not codes:
        raise _lacking(f"needs ignite.engine.Engine.{RUN_FUNCTIONS[-2]}")
    return codes


def handle_exceptions(engine: Any, handler: Callable[[BaseException], None]) -> Callable[[BaseException], None]:
    """``engine`` hands an exception to ``handler`` instead of its ``_handle_exception`` (which fires
    ``EXCEPTION_RAISED``, or raises it when no handler is attached); returns the one it replaced."""
    replaced = engine._handle_exception
    if replaced != handler:  # the same handler attached twice replaces nothing more
        engine._handle_exception, engine._fth_replaced = handler, replaced
    return engine._fth_replaced


def reset_idist(state=None) -> None:
    """``RESET_FRAMEWORKS`` (a recovery step: ``state`` unused): idist's model of the distributed context goes back to a fresh process's."""
    utils = sys.modules.get("ignite.distributed.utils")
    if utils is None:
        return
    missing = [name for name in ("_model", "_need_to_sync", "_SerialModel") if not hasattr(utils, name)]
    if missing:
        raise _lacking(f"needs ignite.distributed.utils.{', '.join(missing)} to recover in place")
    utils._model = utils._SerialModel()
    utils._need_to_sync = True


#: ``take(path)`` (the live state for a name), ``read(path)``, ``after(to_load, checkpoint)``.
_load_hooks: dict[str, Callable] = {}


def hook_load_objects(*, take: Callable[[Any], Any] | None = None, read: Callable[[Any], Any] | None = None,
                      after: Callable[[Any, Any], None] | None = None) -> None:
    """Wrap ``Checkpoint.load_objects`` once per process and add the hooks given: given a path, it loads
    ``take(path, to_load's values)`` when not ``None``, else (with ``after``) ``read(path)``; then ``after``."""
    _load_hooks.update({name: hook for name, hook in (("take", take), ("read", read), ("after", after))
                        if hook is not None})
    module = sys.modules.get("ignite.handlers.checkpoint")
    checkpoint_type = getattr(module, "Checkpoint", None)
    original = getattr(checkpoint_type, "__dict__", {}).get("load_objects")
    if not isinstance(original, staticmethod) or getattr(original.__func__, "_fth_hooked", False):
        return
    load = original.__func__

    @functools.wraps(load)
    def load_objects(to_load: Any, checkpoint: Any, **kwargs: Any) -> Any:
        take, read, after = (_load_hooks.get(name) for name in ("take", "read", "after"))
        if isinstance(checkpoint, (str, Path)):
            objects = list(to_load.values()) if hasattr(to_load, "values") else []
            state = take(checkpoint, objects) if take is not None else None
            if state is not None:
                checkpoint = state
            elif after is not None and read is not None:
                checkpoint = read(checkpoint)
        result = load(to_load, checkpoint, **kwargs)
        if after is not None:
            after(to_load, checkpoint)
        return result

    load_objects._fth_hooked = True  # type: ignore[attr-defined]
    checkpoint_type.load_objects = staticmethod(load_objects)


def step_names(engine: Any) -> list:
    """The values the training step of ``engine`` names: its closure's cells and its code's globals."""
    func = getattr(engine, "_process_function", None)
    func = getattr(func, "func", func)  # a functools.partial
    code = getattr(func, "__code__", None)
    if code is None:
        return []
    found = []
    for cell in func.__closure__ or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    names = getattr(func, "__globals__", {})
    return found + [names[name] for name in code.co_names if name in names]
