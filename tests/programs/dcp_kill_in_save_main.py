"""A rank SIGKILLed in the middle of a distributed checkpoint's save, in a real training job:
``torchrun ... dcp_kill_in_save_main.py <example> [example args]`` runs ``<example>``
(``examples/ignite_fsdp.py`` or ``examples/lightning_model_parallel.py``) as ``__main__`` with DCP's
file writer wrapped, started by ``tests/distributed/test_sharded.py``.

``KILL_IN_SAVE="rank=<r>,step=<n>,at=<shards|metadata>"``: in the first attempt only, rank ``r``
SIGKILLs itself during the save of the checkpoint of step ``n`` (the step read from the directory's
name: ``checkpoint_20``, ``epoch=0-step=20.ckpt``):

* ``shards``: once its own shards are written (``FileSystemWriter.write_data``), before DCP's
  ``.metadata``: the directory holds shards and no ``.metadata``;
* ``metadata``: (rank 0, DCP's coordinator) once ``.metadata`` is written
  (``FileSystemWriter.finish``), before anything the framework writes after it (``DCPSaver``'s
  rename of ``tmp-checkpoint_20``, Lightning's ``meta.pt``).

It prints ``[rank r] killing itself in the save of <dir> (<at>)`` first.
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import sys

from torch.distributed.checkpoint import FileSystemWriter

from fault_tolerant_handlers.core.attempts import current as current_attempt
from fault_tolerant_handlers.core.inject import current_rank

_spec = dict(item.split("=", 1) for item in os.environ["KILL_IN_SAVE"].split(","))
RANK, STEP, AT = int(_spec["rank"]), int(_spec["step"]), _spec["at"]
assert AT in ("shards", "metadata"), AT
_write_data, _finish = FileSystemWriter.write_data, FileSystemWriter.finish


def _maybe_kill(writer: FileSystemWriter, at: str) -> None:
    path = str(writer.path)
    step = re.search(r"(?:checkpoint_|step=)(\d+)", os.path.basename(path.rstrip("/")))
    if at == AT and current_rank() == RANK and current_attempt() == 0 and step and int(step.group(1)) == STEP:
        print(f"[rank {RANK}] killing itself in the save of {os.path.basename(path)} ({at})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def write_data(self, plan, planner):
    future = _write_data(self, plan, planner)
    future.wait()  # this rank's shards are on disk
    _maybe_kill(self, "shards")
    return future


def finish(self, metadata, results) -> None:
    _finish(self, metadata, results)
    _maybe_kill(self, "metadata")


FileSystemWriter.write_data, FileSystemWriter.finish = write_data, finish

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
