"""A partner's copy of a shard whose bytes change while it is held, in a real training job:
``torchrun ... flip_copy_main.py <example> [example args]`` runs ``<example>`` (``examples/ignite_fsdp.py``)
as ``__main__``, started by ``tests/distributed/test_sharded.py``.

``FLIP_COPY=<r>``: in the first attempt only, the copies rank ``r`` holds of other ranks' shards
(:meth:`fault_tolerant_handlers.data.replicas.ShardReplicas.abort`, called by the recovery) have one
byte flipped when the recovery takes them, as a memory error while they were held would. It prints
``[rank r] flipped a byte of its copy of rank <q>'s shard of step <n>``.
"""

from __future__ import annotations

import os
import runpy
import sys

from fault_tolerant_handlers.core.attempts import current as current_attempt
from fault_tolerant_handlers.core.inject import current_rank
from fault_tolerant_handlers.data.replicas import ShardReplicas

RANK = int(os.environ["FLIP_COPY"])
_abort = ShardReplicas.abort


def abort(self):
    snaps = _abort(self)
    if current_rank() == RANK and current_attempt() == 0:
        for snap in snaps:
            if snap.rank != RANK:
                snap.payload[snap.payload.numel() // 2] ^= 0x10
                print(f"[rank {RANK}] flipped a byte of its copy of rank {snap.rank}'s shard of step {snap.step}",
                      flush=True)
    return snaps


ShardReplicas.abort = abort

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
