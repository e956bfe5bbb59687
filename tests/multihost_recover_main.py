"""One rank of a multi-host job that recovers in place: ``resume_main.py``'s seeded 2-rank Ignite
training (``FaultTolerance``, a checkpoint every ``EVERY`` iterations, resumed from the newest one)
wrapped in ``recover_in_place(max_restarts=INPLACE)``, with the events the multi-host tests read.

Started by ``torchrun`` inside a simulated host (``tests/hosts.py``), one rank per host::

    python -m torch.distributed.run --nnodes 2 ... multihost_recover_main.py <outdir>

Besides ``resume_main.py``'s files (``attempt<A>_rank<R>.json`` with the training process's pid,
``batches<R>.jsonl``, ``weights.pt``, ``ckpt/``), every rank appends JSON events with wall-clock
times to ``<outdir>/rank<r>.jsonl``: ``start`` (host name, pid in its host: the keeper's, the process
torchrun started), ``attempt`` (each call of the training function: its number, the pid of the
process that trains and of its parent), ``ready`` (iteration ``READY_ITER`` of attempt 0 reached and
every rank's liveness helper beating: the rig injects host faults after every rank is ready),
``fault`` (an ``FTH_INJECT`` injection firing on this rank), ``run_raised`` (in the training
process: the exception the recovery ended with, its ``PeerFailedError`` fields and its notes),
``exit`` (in the keeper, as it returns or ends).

Environment (besides ``resume_main.py``'s ``EPOCHS``, ``EVERY``, ``FTH_INJECT``, ...):
    FRAMEWORK    ``ignite`` (the default) or ``lightning``: ``resume_main.py``'s training of that framework
    INPLACE      max_restarts of ``recover_in_place`` (default 2)
    STEP_SEC     extra time per step, seconds (default 0): a run long enough for a host fault
    READY_ITER   iteration of attempt 0 at which ``ready`` is recorded (default 10)
    READY_HOLD_SEC  seconds each rank waits inside the step where it recorded ``ready`` (default 0): a
                 host fault injected at ``ready`` then lands inside a step, after its start (with
                 ``FTH_SHARD_REPLICAS``, every copy of the step before acknowledged)
    STALL_AFTER_STEP  ``resume_main.py``'s ``<rank>:<iteration>``: that rank records ``ready`` where it
                 stalls (after its optimizer step, before the step's end handlers), not at the step's start
    SPARES       spares of ``recover_in_place`` (default 0): the last launched ranks wait, and one takes
                 the place of a rank lost with no keeper; a spare's events stay in the file of its
                 launched rank (``rank<launched>.jsonl``), its training files are the rank's it took
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

OUT = Path(sys.argv[1])
sys.path.insert(0, str(Path(__file__).resolve().parent))
# multihost_main's event log and readiness check, the same for this program (it reads its directory
# from argv too: imported before argv is rewritten for resume_main)
from multihost_main import _settled, record  # noqa: E402
FRAMEWORK = os.environ.get("FRAMEWORK", "ignite")
sys.argv = [sys.argv[0], FRAMEWORK, str(OUT)]  # resume_main reads its framework and directory from argv

# The framework and the library's adapter of it imported before the keeper forks, at the top, as a
# script's imports are (the README's): resume_main imports the adapter inside its training function,
# which a spare would pay when it takes a seat (0.4-0.6 s for Lightning's on a loaded machine).
if FRAMEWORK == "lightning":
    import lightning.pytorch  # noqa: E402, F401
    import fault_tolerant_handlers.lightning  # noqa: E402, F401
else:
    import ignite.engine  # noqa: E402, F401
    import fault_tolerant_handlers.ignite  # noqa: E402, F401
import resume_main  # noqa: E402

from fault_tolerant_handlers import recover_in_place, recovery_attempt  # noqa: E402

RANK = int(os.environ["RANK"])
INPLACE = int(os.environ.get("INPLACE", "2"))
STEP_SEC = float(os.environ.get("STEP_SEC", "0"))
READY_ITER = int(os.environ.get("READY_ITER", "10"))
READY_HOLD_SEC = float(os.environ.get("READY_HOLD_SEC", "0"))
SPARES = int(os.environ.get("SPARES", "0"))


class Trace(resume_main.Trace):
    """resume_main's batch trace, plus ``STEP_SEC`` per step and the ``ready`` event."""

    ready = False

    def __call__(self, step: int, idx) -> None:
        super().__call__(step, idx)
        stalls = resume_main.STALL is not None and resume_main.STALL[0] == RANK
        if not stalls and not Trace.ready and recovery_attempt() == 0 and step >= READY_ITER and _settled():
            Trace.ready = True
            record("ready", iteration=step)
            time.sleep(READY_HOLD_SEC)
        if STEP_SEC:
            time.sleep(STEP_SEC)


resume_main.Trace = Trace
_stall = resume_main.stall_until_a_peer_failed


def stall() -> None:
    record("ready", iteration=resume_main.STALL[1], stalled=True)
    _stall()


resume_main.stall_until_a_peer_failed = stall


class RecordInjected(logging.StreamHandler):
    """An ``FTH_INJECT`` injection firing on this rank: the ``fault`` event; the library's warnings
    and errors printed to stderr, as logging's last-resort handler would without this one."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)

    def emit(self, rec: logging.LogRecord) -> None:
        msg = rec.getMessage()
        if "FTH_INJECT" in msg and "injecting" in msg:
            record("fault", message=msg)
        super().emit(rec)


def train() -> None:
    record("attempt", attempt=recovery_attempt(), pid=os.getpid(), ppid=os.getppid())
    resume_main.run_lightning() if FRAMEWORK == "lightning" else resume_main.run_ignite()


def excepthook(kind, exc, tb) -> None:
    """What the training process ended with (the keeper's child prints its exception with
    ``sys.excepthook``): recorded, then printed as usual."""
    fields = dict(raised=kind.__name__, message=str(exc)[:4000], notes=list(getattr(exc, "__notes__", []) or []),
                  pid=os.getpid())
    for attr in ("failed_rank", "host", "exc_type", "exc_message", "where"):
        if hasattr(exc, attr):
            fields["peer_" + attr if attr == "host" else attr] = getattr(exc, attr)
    record("run_raised", **fields)
    sys.__excepthook__(kind, exc, tb)


def main() -> None:
    resume_main.CKPT.mkdir(parents=True, exist_ok=True)
    record("start", host=socket.gethostname(), pid=os.getpid())
    logging.getLogger("fault_tolerant_handlers").addHandler(RecordInjected())
    sys.excepthook = excepthook
    try:
        recover_in_place(train, max_restarts=INPLACE, spares=SPARES)()
    except BaseException as exc:
        record("exit", how=f"{type(exc).__name__}: {exc}", pid=os.getpid())
        raise
    record("exit", how="returned", pid=os.getpid())


if __name__ == "__main__":
    main()
