"""The interrupt of a hung main thread, and the sections it waits outside.

Recovering in place (:func:`fault_tolerant_handlers.recover_in_place`), a rank hung in Python is
interrupted where it hangs: its watchdog hands :func:`interrupt` a
:class:`~.errors.HangInterrupted` and sends the main thread a signal whose handler raises it. Three
rules keep that interrupt from doing harm:

* **It cannot be swallowed by accident.** ``HangInterrupted`` derives from ``BaseException``, so an
  ``except Exception:`` lets it through. It stays *pending* until the recovery takes it
  (:func:`take`): code that catches it anyway (``except BaseException:``, a bare ``except:``) and
  carries on meets it again at the next point where the library gets control in the main thread:
  an adapter's hook (:func:`raise_pending`: every Ignite event and Lightning hook the adapters
  handle), the end of a deferred section, and the watchdog's next signal (every
  :data:`~.config.INTERRUPT_RESEND` seconds until the main thread reached the recovery). It is not
  raised again while the main thread is already handling it (an ``except`` or ``finally`` clause on
  its way out, the frameworks' exception paths).
* **It waits outside deferred sections.** Inside :class:`deferred_interrupt` (the library's checkpoint
  writes and its main-thread store calls, and any section of the user's) the signal's handler does
  not raise: the interrupt is raised as the outermost section ends. A checkpoint write that the
  main thread's stack shows (``torch.save``, a ``save_checkpoint``, Ignite's ``DiskSaver``:
  :mod:`..detect.writes` tells) defers it too, until the watchdog's next signal after the write.
* **The wait is bounded.** A section that does not end within ``FTH_INTERRUPT_DEFER_SEC``
  (:data:`~.config.INTERRUPT_DEFER`, 30 s) of the interrupt's first arrival is interrupted inside
  it: a section that never ends must not turn a hang the recovery could take into one it cannot
  (the peers wait ``FTH_RECOVER_JOIN_SEC`` for this rank).

A main thread stuck in C runs no handler at all: the watchdog ends that process as before, after
:data:`~.config.INTERRUPT_WAIT`.

The state is the process's (one main thread): the pending interrupt, the depth of the main thread's
deferred sections and when the interrupt first found it inside one. The signal handler takes no
lock (it runs in the main thread, which may hold any lock when the signal arrives).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from contextlib import ContextDecorator
from datetime import timedelta
from types import CodeType, FrameType, TracebackType

from . import hooks
from .log import log

_pending: BaseException | None = None  # delivered, not yet taken by the recovery
#: The recovery took the interrupt (:func:`take`) and has not called the training function again
#: (:func:`arm`): the main thread is in the recovery, and a later interrupt (a peer's watchdog that
#: declared its own rank hung behind the hung one, a moment after) has nothing to interrupt.
_taken = False
_depth = 0  # the main thread's deferred sections, nested
_deferred_at: float | None = None  # when the pending interrupt first found the main thread in one
_bound = 30.0  # seconds: how long a section may hold the interrupt back (set by install)
_signum: int | None = None  # the signal of the installed handler
_takers: frozenset[CodeType] = frozenset()  # frames that take the interrupt: never raised in them
_lock = threading.Lock()  # interrupt / resend / uninstall against each other (never in the handler)
def _in_main_thread() -> bool:
    return threading.get_ident() == threading.main_thread().ident


def _handling(err: BaseException) -> bool:
    """The main thread handles ``err`` already: an ``except``/``finally`` clause (or one an exception
    it caused is raised in) is on its way out with it."""
    seen = sys.exc_info()[1]
    for _ in range(32):  # a chain of contexts is short; a cycle must not hang the handler
        if seen is None:
            return False
        if seen is err:
            return True
        seen = seen.__context__
    return False


class deferred_interrupt(ContextDecorator):  # noqa: N801 - used like a function: ``with deferred_interrupt():``
    """Context manager (or decorator): the interrupt of a hung main thread waits until the section ends.

    Recovering in place, a rank hung in Python is interrupted where it hangs
    (:class:`~fault_tolerant_handlers.HangInterrupted`). Inside this section the interrupt waits: it
    is raised as the outermost section ends, so the section is never left half done. The library's
    own checkpoint writes (:class:`~fault_tolerant_handlers.ignite.SafeDiskSaver`, the Lightning
    callback's strategy saves, :func:`~fault_tolerant_handlers.writing_checkpoint` blocks) and its
    main-thread store calls run inside one.

    The wait is bounded: a section still running ``FTH_INTERRUPT_DEFER_SEC`` (30 s) after the
    interrupt first arrived is interrupted inside it, so that a section that hangs itself does not
    keep the rank out of the recovery (its peers wait ``FTH_RECOVER_JOIN_SEC``, 60 s, for it).
    Sections nest; they count in the main thread only (the interrupt goes nowhere else): in another
    thread this is a no-op. Outside ``recover_in_place`` nothing is ever interrupted, and a section
    costs two attribute updates.

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers import deferred_interrupt

            with deferred_interrupt():            # a manifest and its data, both or neither
                write_shard(path, data)
                append_manifest(manifest, path)

            @deferred_interrupt()
            def upload_metrics(run, metrics): ...
    """

    # Stateless (the depth is the process's): one object serves every thread and nesting.

    def __enter__(self) -> deferred_interrupt:
        global _depth
        if _in_main_thread():
            _depth += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        global _depth
        if not _in_main_thread():
            return False
        _depth = max(0, _depth - 1)  # (a child forked inside a section starts at 0)
        err = _pending
        if _depth == 0 and err is not None and exc is not err and not _handling(err):
            log(logging.WARNING, "the interrupt of the hung main thread, held back by a deferred section, is raised "
                "now that the section ended")
            raise err
        return False


#: The section the library's own hot paths enter (its store calls): made once, reentrant.
SECTION = deferred_interrupt()


def raise_pending() -> None:
    """At a point where the library gets control in the main thread (an adapter's hook): raise the
    pending interrupt again if user code swallowed it. Outside a deferred section only; never while
    the main thread handles it already. One global read when nothing is pending."""
    err = _pending
    if err is None or _depth or not _in_main_thread() or _handling(err):
        return
    log(logging.WARNING, "the interrupt of the hung main thread was caught and not re-raised (an except "
        "BaseException, a bare except): raised again here")
    raise err


def pending() -> BaseException | None:
    """The interrupt delivered and not yet taken, if any."""
    return _pending


def deferred_until() -> float | None:
    """While a deferred section holds the interrupt back: the ``time.monotonic()`` at which the
    section's bound runs out (the watchdog waits that long, plus its usual wait); ``None`` otherwise."""
    since = _deferred_at
    return None if since is None or _pending is None else since + _bound


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """The signal's handler, in the main thread (takes no lock)."""
    global _deferred_at
    err = _pending
    if err is None:
        return
    if frame is not None and frame.f_code in _takers:
        return  # the recovery's own frame: it takes the interrupt there
    if _handling(err):
        return  # on its way out already (an exception path, a finally)
    if _depth or (frame is not None and any(defer(frame) for defer in hooks.callbacks(hooks.DEFER))):
        now = time.monotonic()
        if _deferred_at is None:
            _deferred_at = now
            log(logging.WARNING, "the hung main thread is in a deferred section (%s): its interrupt waits until the "
                "section ends, %.0f s at most (FTH_INTERRUPT_DEFER_SEC)",
                "deferred_interrupt" if _depth else "a checkpoint write", _bound)
        if now - _deferred_at < _bound:
            return
        log(logging.ERROR, "a deferred section held the interrupt of the hung main thread back for %.0f s "
            "(FTH_INTERRUPT_DEFER_SEC): interrupted inside it", now - _deferred_at)
    raise err


def install(signum: int, bound: timedelta, takers: tuple[CodeType, ...] = ()) -> object:
    """Install the interrupt's handler for ``signum`` (main thread only); frames running one of
    ``takers`` (the recovery's) take the interrupt and never have it raised in them. Returns what
    :func:`uninstall` restores."""
    global _signum, _takers, _bound
    previous = signal.signal(signum, _on_signal)
    with _lock:
        state = (_signum, _takers, _bound, previous)
        _signum, _takers, _bound = signum, frozenset(takers) | {take.__code__}, bound.total_seconds()
    _clear()
    return state


def uninstall(state: object) -> None:
    """Restore what :func:`install` replaced; a pending interrupt is dropped."""
    global _signum, _takers, _bound
    signum = _signum
    with _lock:  # no resend after this: the previous handler may be the default (it ends the process)
        _signum, _takers, _bound, previous = state  # type: ignore[misc]
    _clear()
    if signum is not None:
        signal.signal(signum, previous)


def interrupt(error: BaseException) -> bool:
    """From the watchdog's thread: make ``error`` the pending interrupt (unless one is pending
    already) and signal the main thread. False when no handler is installed, or when the recovery
    has taken an interrupt and not called the training function again (:func:`take`, :func:`arm`):
    the main thread is in the recovery already, where an interrupt raised in a callee (a watchdog's
    join) would end the recovery."""
    global _pending
    with _lock:
        if _signum is None or _taken:
            return False
        if _pending is None:
            _pending = error
        signal.pthread_kill(threading.main_thread().ident, _signum)
        return True


def resend() -> bool:
    """The watchdog's next signal, while the interrupt is still pending: raised now unless the main
    thread is in a deferred section (within its bound) or on its way out with it."""
    with _lock:
        if _signum is None or _pending is None:
            return False
        signal.pthread_kill(threading.main_thread().ident, _signum)
        return True


def take() -> BaseException | None:
    """The recovery takes the interrupt (whatever ended the attempt): it is no longer pending, and no
    later signal raises it; no later :func:`interrupt` is accepted until :func:`arm`. Returns it, if
    there was one."""
    global _pending, _deferred_at, _taken
    with _lock:  # against interrupt(): after this, none is accepted (never taken in the handler)
        err, _pending, _deferred_at, _taken = _pending, None, None, True
    return err


def taken() -> bool:
    """Whether the recovery has taken an interrupt and not called the training function again."""
    return _taken


def arm() -> None:
    """The recovery calls the training function again: an interrupt is accepted again."""
    global _taken
    with _lock:
        _taken = False


def _clear() -> None:
    global _pending, _deferred_at, _taken
    _pending, _deferred_at, _taken = None, None, False


def _after_fork_in_child() -> None:
    # A child (a DataLoader worker, a replacement rank) starts with nothing pending and no section
    # open: its main thread is the thread that forked.
    global _depth, _lock
    _lock = threading.Lock()
    _depth = 0
    _clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
