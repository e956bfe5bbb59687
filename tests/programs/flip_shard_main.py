"""A sharded model's live state whose bytes change while it is held, in a real training job:
``torchrun ... flip_shard_main.py <example> [example args]`` runs ``<example>``
(``examples/ignite_fsdp.py`` or ``examples/lightning_model_parallel.py``) as ``__main__``, started by
``tests/distributed/test_sharded.py``.

``FLIP_SHARD=<r>``: in the first attempt only, rank ``r``'s shard snapshot taken at the failure
(:func:`fault_tolerant_handlers.core.sharded.take_snapshot`, called by the data layer's capture) has
one byte of its bytes flipped once it is checksummed, as a memory error while it is held would. It
prints ``[rank r] flipped a byte of its shard of step <n>``.
"""

from __future__ import annotations

import os
import runpy
import sys

from fault_tolerant_handlers.core import sharded
from fault_tolerant_handlers.core.attempts import current as current_attempt
from fault_tolerant_handlers.core.inject import current_rank

RANK = int(os.environ["FLIP_SHARD"])
_take_snapshot = sharded.take_snapshot


def take_snapshot(state, step, rank, **kwargs):
    snap = _take_snapshot(state, step, rank, **kwargs)
    if current_rank() == RANK and current_attempt() == 0:
        snap.payload[snap.payload.numel() // 2] ^= 0x10
        print(f"[rank {RANK}] flipped a byte of its shard of step {step}", flush=True)
    return snap


sharded.take_snapshot = take_snapshot

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
