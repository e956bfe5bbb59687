"""Replacing a dead rank's process in place (``docs/recovering.md``): under torchrun the worker is the
**keeper** of its rank and its forked child trains; when the child is killed, or ends hung
(:data:`~..core.errors.EXIT_HUNG`) or stuck after its release (:data:`~..core.errors.EXIT_PEER_FAILED`), the
keeper forks a **replacement** (a copy made before anything trained: no CUDA in the keeper), which joins
the recovery its peers wait in. The return value comes back pickled, in a file of the keeper's own.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import mmap
import os
import pickle
import signal
import struct
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from ..core import attempts, compat_torch, interrupts
from ..core.config import ZOMBIE_HOLD
from ..core.errors import EXIT_HUNG, EXIT_PEER_FAILED
from ..core.failure import Ended, FailureRecord
from ..core.hooks import log
from ..core.schema import keeper_key
from . import spares

#: What a keeper runs: ``recover.inplace._Recovery`` (not imported: it imports this module).
_Recovery = Any

#: ``prctl`` option: the signal this process gets when its parent dies.
PR_SET_PDEATHSIG = 1
#: Signals the keeper forwards to its child.
FORWARDED = (signal.SIGTERM, signal.SIGINT)
#: Largest return value the child may hand back (bytes, pickled).
MAX_RESULT_BYTES = 256 * 1024 * 1024


#: Reasons of :func:`why_not` that no change to the script can remove (the launcher, the platform).
NO_KEEPER_HERE = ("only on Linux", "not under torchrun")


def why_not(recovery: _Recovery) -> str | None:
    """Why no keeper can be started here (``None``: it can)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "only on Linux"
    if not attempts.under_torchrun():
        return "not under torchrun: the store's server may live in a rank's own process"
    if recovery.given is not None:
        return "the process group existed before recover_in_place was called; call it before init_process_group"
    if threading.current_thread() is not threading.main_thread():
        return "recover_in_place was not called in the main thread"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ("CUDA was initialised before recover_in_place was called: call it before anything touches the "
                "GPU (each child initialises CUDA itself)")
    return None


def run(recovery: _Recovery, args: tuple, kwargs: dict) -> Any:
    """``recovery``'s attempts under a keeper where one can start; else in this process, the reason logged."""
    why = why_not(recovery)
    if why is None:
        return Keeper(recovery).run(args, kwargs)
    given = recovery.given is not None and attempts.under_torchrun()
    if given:
        _warn_group_made_before()  # names the line to change
    # a reason the script can change (CUDA touched first, another thread) is a WARNING
    level = logging.INFO if given or why.startswith(NO_KEEPER_HERE) else logging.WARNING
    log(level, "a dead rank's process cannot be replaced in place here (%s): its death ends the job "
        "as without recovery in place", why)
    return recovery.run(args, kwargs)


@functools.cache
def _warn_group_made_before() -> None:
    """Once per process: a killed rank cannot be replaced inside a group that exists already: the fix."""
    log(logging.WARNING, "recover_in_place was called inside a process group that exists already, so a killed rank "
        "(SIGKILL, the OOM killer, a segfault) cannot be replaced in place and ends the job (exceptions and hangs in "
        "Python still recover in place). To recover it too, wrap the function that makes the group instead: "
        "replace 'with idist.Parallel(backend=...) as p: p.run(recover_in_place(training, ...), cfg)' with "
        "'recover_in_place(main, ...)(cfg)' where main(cfg) runs 'with idist.Parallel(backend=...) as p: "
        "p.run(training, cfg)'; or call the wrapped function before init_process_group (docs/recovering.md, "
        "\"Launchers\")")


#: In a keeper's child only (set by :meth:`Keeper.run` after the fork): its :class:`Keeper` and the
#: keeper's pid, what ``LOSE``, ``KEEPER_PID`` and ``SESSION_STARTED`` (``wiring.py``) answer from.
_child_of: tuple[Keeper, int] | None = None
#: In a keeper's child: the store its keeper key was announced in (deleted there when the rank is lost).
_announced = None


def on_session_started(session) -> None:
    """``SESSION_STARTED``, in a keeper's child: its peers may wait for a replacement of this rank."""
    global _announced
    if _child_of is None or session.group is not None:
        return
    try:
        _announced = compat_torch.store_chain(session.pg_store)[-1]  # the rendezvous's own
        _announced.set(keeper_key(session.rank), "1")
    except Exception as err:  # noqa: BLE001 - without it a death of this rank ends the job, as without a keeper
        log(logging.WARNING, "could not announce this rank's keeper: %s", err)


def keeper_pid() -> int | None:
    """``KEEPER_PID``: in a keeper's child, the pid of the keeper that would replace it; else ``None``."""
    return None if _child_of is None else _child_of[1]


def lose() -> None:
    """``LOSE``, in a keeper's child about to kill itself as a lost rank (``FTH_INJECT``'s ``lose``): its
    keeper will not replace it, and its key goes first."""
    if _child_of is None:
        return
    struct.pack_into("<q", _child_of[0].page, 8, 1)
    store = _announced
    if store is not None:
        try:
            store.delete_key(keeper_key(int(os.environ.get("RANK", "-1"))))
        except Exception as err:  # noqa: BLE001 - its peers then wait for a replacement that never comes
            log(logging.WARNING, "could not withdraw this rank's keeper key: %s", err)


class Keeper:
    """The launcher's process of one rank, keeping the child that trains."""

    def __init__(self, recovery: _Recovery) -> None:
        self.recovery = recovery
        #: Shared with every child: the attempt (recoveries in place so far) the child is in.
        self.page = mmap.mmap(-1, mmap.PAGESIZE)
        self.child: int | None = None
        #: Where the child leaves its return value (a file of this process's own: not the store).
        fd, self.result_path = tempfile.mkstemp(prefix="fth-result-")
        os.close(fd)

    # -- in the child (the page: the attempt it is in at 0, 1 at 8 when it was lost for good) ------------
    def _write_attempt(self, count: int) -> None:
        struct.pack_into("<q", self.page, 0, count)

    def _child(self, result_path: str, args: tuple, kwargs: dict, replacement: FailureRecord | None,
               order: spares.Order | None) -> None:
        """The training child: never returns (its exit code tells the keeper how it ended)."""
        code = 1
        try:
            try:
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            except Exception as err:  # noqa: BLE001 - best effort: without it a killed keeper leaves its child
                log(logging.WARNING, "could not tie this process to its keeper: %s", err)
            interrupts.spare_inherited_sockets()  # the keeper's (a store client of its own): never cut here
            for sig in FORWARDED:
                signal.signal(sig, signal.SIG_DFL)
            self.recovery.on_attempt = self._write_attempt
            result = self.recovery.run(args, kwargs, replacement=replacement, order=order)
            try:
                data = pickle.dumps(result)
            except Exception as err:  # noqa: BLE001
                log(logging.WARNING, "the training function's return value cannot be handed to the keeper "
                    "(%s: %s): it returns None", type(err).__name__, err)
                data = pickle.dumps(None)
            with open(result_path, "wb") as file:
                file.write(data)
            code = 0
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the exit code says it
            sys.excepthook(*sys.exc_info())
        finally:
            try:
                atexit._run_exitfuncs()  # the library's and torch's exit hooks, as at a normal exit
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    # -- in the keeper --------------------------------------------------------------------------------
    def run(self, args: tuple, kwargs: dict, replacement: FailureRecord | None = None,
            order: spares.Order | None = None) -> Any:
        """Keep the training child, and a new one each time it dies (``replacement``, ``order``: a spare's
        first child joins the recovery as the rank it takes)."""
        global _child_of
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        self._write_attempt(attempts.in_place())  # a child that dies before its first attempt began is in this one
        # imported by the first child's DDP anyway: here, a replacement forked later has it too (0.3-0.5 s)
        compat_torch.import_lazy_modules(dcp=False)
        dead = None
        rank = os.environ.get("RANK", "?")
        try:
            while True:
                keeper = os.getpid()  # read here: a child whose keeper died before it looked would read its reaper
                pid = os.fork()
                if pid == 0:
                    _child_of = (self, keeper)
                    self._child(self.result_path, args, kwargs, replacement, order)
                order = None  # a spare's order was its first child's; a later child is a keeper's replacement
                self.child = pid
                if dead is not None:  # the child before, a zombie until its peers read how it ended
                    time.sleep(ZOMBIE_HOLD)
                    os.waitpid(dead, 0)
                    dead = None
                status = self._wait(pid)
                self.child = None
                how = Ended.from_status(status).describe()
                if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                    os.waitpid(pid, 0)
                    with open(self.result_path, "rb") as file:  # unlinked on the way out (below)
                        data = file.read(MAX_RESULT_BYTES + 1)
                    # written by this process's own child, not read from the store
                    return pickle.loads(data) if data and len(data) <= MAX_RESULT_BYTES else None  # noqa: S301
                lost = struct.unpack_from("<q", self.page, 8)[0] == 1  # lost for good (LOSE)
                if lost and self.recovery.layout is not None:
                    time.sleep(ZOMBIE_HOLD)  # a zombie until its peers read how it ended
                    os.waitpid(pid, 0)
                    return self._stand_by(pid, how)
                attempt = struct.unpack_from("<q", self.page, 0)[0]
                # killed, hung (88), or released but stuck where no release reaches (87): replaced alike
                replaceable = os.WIFSIGNALED(status) or os.WEXITSTATUS(status) in (EXIT_HUNG, EXIT_PEER_FAILED)
                if replaceable and attempt < self.recovery.max_restarts and not self._stopping:
                    replacement = FailureRecord.replaced(int(rank), f"the process of rank {rank} (pid {pid}) {how}: replaced in place")
                    attempts.set_in_place(attempt)
                    dead = pid
                    log(logging.WARNING, "the training process of rank %s (pid %d) %s: starting its replacement, which "
                        "joins the recovery of attempt %d", rank, pid, how, attempt)
                    continue
                log(logging.ERROR, "the training process of rank %s (pid %d) %s%s", rank, pid, how,
                    "" if not replaceable else (": not replaced (a signal to stop)" if self._stopping else
                                                f": not replaced (max_restarts={self.recovery.max_restarts} spent)"))
                os.waitpid(pid, 0)
                self._end_like(status)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if os.path.exists(self.result_path):
                os.unlink(self.result_path)

    def _stand_by(self, pid: int, how: str) -> Any:
        """The child was lost on purpose (a host's loss rehearsed): a spare takes its rank, and this worker
        stays until the job ends (torchrun would end its host's workers): ``None``, or exit 1 on a failure."""
        lay = self.recovery.layout
        for sig in FORWARDED:  # nothing to forward to: torchrun's SIGTERM ends this process
            signal.signal(sig, signal.SIG_DFL)
        log(logging.WARNING, "the training process of rank %s (pid %d) %s, lost for good (FTH_INJECT lose): not "
            "replaced; this process (launched rank %d) stays idle until the job ends", os.environ.get("RANK", "?"),
            pid, how, lay.launched_rank)
        order = spares.wait_for_order(attempts.agent_store(self.recovery.join_timeout), lay, lay.launched_rank,
                                      end_only=True)
        if order.kind == spares.END and order.ok:
            return None
        log(logging.ERROR, "launched rank %d: the job ended: %s", lay.launched_rank, order.why)
        raise SystemExit(1)

    @staticmethod
    def _wait(pid: int) -> int:
        """The wait status of ``pid`` once it ended, left a zombie (``WNOWAIT``) for its peers to read."""
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # retried after a forwarded signal (PEP 475)
        if info.si_code == os.CLD_EXITED:
            return (info.si_status & 0xFF) << 8
        return info.si_status & 0x7F  # killed (or dumped core): the signal's number

    _stopping = False

    def _forward(self, signum, frame) -> None:
        self._stopping = True
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signum)

    @staticmethod
    def _end_like(status: int) -> None:
        """End the keeper the way its child ended: the same signal, or the same exit code."""
        sys.stdout.flush()
        sys.stderr.flush()
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        raise SystemExit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
