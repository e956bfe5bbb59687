"""A rank ended from outside while it fails still says why, before it goes.

Launchers end the surviving ranks of a failing job by SIGTERM as soon as one rank is gone:
torchrun's agent when it loses its rendezvous store (the store's host died), ``torch.multiprocessing``
(``idist.Parallel``, Lightning ``ddp_spawn``) when one child exits. A rank that is at that moment
working out which peer failed would die without a word. So, from the main thread, the library
chains a SIGTERM handler in front of whatever handler was there (the default, Lightning's, the
user's): when a failure is known or being explained, it waits for the explanation (at most
:data:`REPORT_WAIT`), writes the report to stderr and the log, then hands the signal on unchanged.
Without a failure under way it hands it on at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import weakref
from typing import TYPE_CHECKING

from ._log import log

if TYPE_CHECKING:
    from .session import Session

#: How long a SIGTERMed rank waits for the explanation of a failure under way.
REPORT_WAIT = 1.5

_sessions: weakref.WeakSet = weakref.WeakSet()
_previous: object = None
_installed = False


def watch(session: Session) -> None:
    """Report ``session``'s failure if this process is terminated (installed once, main thread)."""
    global _installed, _previous
    _sessions.add(session)
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        _previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True
    except (ValueError, OSError):  # not the main interpreter
        pass


def _on_sigterm(signum, frame) -> None:
    err = None
    for session in list(_sessions):
        err = session.failure_report(REPORT_WAIT)
        if err is not None:
            break
    if err is not None:
        code = 128 + signum
        log(logging.CRITICAL, "ending this process with exit code %d: terminated by SIGTERM while the job fails: %s", code,
            str(err).splitlines()[0])
        try:
            sys.stderr.write(f"[rank {os.environ.get('RANK', '?')}] fault-tolerant-handlers: terminated by SIGTERM "
                             f"while the job fails:\n{err}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # the default: end as SIGTERM would have
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
