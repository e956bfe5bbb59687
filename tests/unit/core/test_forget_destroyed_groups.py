"""A destroyed default group that torch keeps as a default argument, let go after a recovery's
``destroy_process_group`` (:func:`compat_torch.forget_destroyed_groups`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# A fresh process: torch.distributed.nn.functional must be imported there for the first time while a
# group exists (as a DistributedDataParallel made after init_process_group imports it).
PROGRAM = textwrap.dedent("""
    import gc, sys, weakref
    import torch.distributed as dist
    from fault_tolerant_handlers.core import compat_torch
    assert "torch.distributed.nn.functional" not in sys.modules
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    import torch.distributed.nn.functional as functional
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    assert group() is not None, "torch no longer keeps it: forget_destroyed_groups can go"
    import warnings
    with warnings.catch_warnings(record=True) as seen:  # at each recovery in place, on every rank
        warnings.simplefilter("always")
        assert compat_torch.forget_destroyed_groups() == 10  # broadcast, gather, ..., all_reduce
    assert not seen, [str(w.message) for w in seen]  # torch.distributed.reduce_op's FutureWarning 3 times
    gc.collect()
    assert group() is None, "still held"
    assert functional.broadcast.__defaults__ == (None,)  # torch's: the default group of the moment
    assert compat_torch.forget_destroyed_groups() == 0
""")


def test_a_destroyed_group_kept_as_torchs_default_argument_is_let_go(tmp_path: Path) -> None:
    """``torch.distributed.nn.functional``'s ``group=group.WORLD`` keeps the group of its import
    alive (its gloo threads, sockets and buffers) after ``destroy_process_group``; once forgotten,
    it is freed and those functions use the default group of the moment."""
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
