"""Distributed checkpoints killed midway: ``python dcp_save_main.py <dir>`` (one process, a sharded
model on a one-rank gloo group), started and killed by ``tests/distributed/test_sharded.py``.

In each of three folders of ``<dir>`` a complete checkpoint of step 10 is written; then a newer one
of step 20 is started in each (three threads) and stops where its case says; once all three have
stopped, this process writes ``<dir>/stopped`` and waits to be killed (SIGKILL by pid):

* ``dcp/``: ``torch.distributed.checkpoint.save`` into ``checkpoint_20``: every shard written, DCP's
  ``.metadata`` not yet (its writer's ``finish`` waits);
* ``saver/``: :class:`~fault_tolerant_handlers.ignite.DCPSaver` (Ignite's ``Checkpoint``), the same
  stop: its ``tmp-checkpoint_20`` is left;
* ``lightning/``: Lightning's sharded form, ``epoch=0-step=20.ckpt`` with DCP's ``.metadata`` written
  and ``meta.pt`` (written after it) not yet;
* ``replace/``: ``DCPSaver`` saves ``checkpoint_10`` again (a name already there) and stops inside the
  removal of the one it replaces, one file (``rank0.pt``) removed.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.fsdp import fully_shard

from fault_tolerant_handlers import ShardedState
from fault_tolerant_handlers.ignite import DCPSaver

STOPPED = threading.Semaphore(0)
_finish = FileSystemWriter.finish


def finish_or_stop(self, metadata, results) -> None:
    """DCP's last step (its ``.metadata``): done for the complete saves and Lightning's, never
    for the torn ones of ``dcp/`` and ``saver/``."""
    path = str(self.fs.concat_path(self.path, ""))
    if "step=" in path or "replace" in path or not TORN.is_set():
        return _finish(self, metadata, results)
    STOPPED.release()
    time.sleep(600)


TORN = threading.Event()
_rmtree = shutil.rmtree


def rmtree_or_stop(path, *args, **kwargs) -> None:
    """A removal of a complete checkpoint of ``replace/`` stops after its first file (``rank0.pt``)."""
    path = Path(path)
    if TORN.is_set() and path.parent.name == "replace" and (path / ".metadata").is_file():
        (path / "rank0.pt").unlink()
        STOPPED.release()
        time.sleep(600)
    return _rmtree(path, *args, **kwargs)


def main(root: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    state = {"model": model.state_dict()}
    FileSystemWriter.finish = finish_or_stop
    saver = DCPSaver(root / "saver")
    saver({"app": ShardedState(model).state_dict()}, "checkpoint_10.pt")
    replace = DCPSaver(root / "replace")
    replace({"app": ShardedState(model).state_dict()}, "checkpoint_10.pt")
    dcp.save(state, checkpoint_id=str(root / "dcp" / "checkpoint_10"), no_dist=True)
    for step in (10, 20):
        (root / "lightning" / f"epoch=0-step={step}.ckpt").mkdir(parents=True)

    def lightning() -> None:
        for step in (10, 20):
            path = root / "lightning" / f"epoch=0-step={step}.ckpt"
            dcp.save({"state_dict": state["model"]}, checkpoint_id=str(path), no_dist=True)
            if step == 20:
                STOPPED.release()
                time.sleep(600)
            torch.save({"global_step": step, "epoch": 0}, path / "meta.pt")

    shutil.rmtree = rmtree_or_stop
    TORN.set()
    threads = [lambda: replace({"app": ShardedState(model).state_dict()}, "checkpoint_10.pt"),
               lambda: saver({"app": ShardedState(model).state_dict()}, "checkpoint_20.pt"),
               lambda: dcp.save(state, checkpoint_id=str(root / "dcp" / "checkpoint_20"), no_dist=True), lightning]
    for target in threads:
        threading.Thread(target=target, daemon=True).start()
    for _ in threads:
        STOPPED.acquire()
    (root / "stopped").write_text("stopped")
    time.sleep(600)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
