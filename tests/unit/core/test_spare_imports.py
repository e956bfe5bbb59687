"""A spare imports, while it waits, what a taken seat's first step would otherwise import lazily
(seconds of its takeover): torch's compiler front end (the first optimizer) and, for a sharded model,
``torch.distributed.checkpoint`` (the shard's load)."""

from __future__ import annotations

import subprocess
import sys


def test_a_waiting_spare_has_the_lazily_imported_modules_of_a_first_step_and_a_shard_load() -> None:
    wanted = ("torch._dynamo", "torch.distributed.checkpoint")
    code = ("import sys\n"
            "from fault_tolerant_handlers.core import compat_torch\n"
            f"before = [m for m in {wanted!r} if m in sys.modules]\n"
            "compat_torch.import_lazy_modules()\n"
            f"print(before, [m for m in {wanted!r} if m not in sys.modules])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, missing = done.stdout.strip().split("] [")
    assert before == "[", f"imported before the call: {before}]"  # the test means something
    assert missing == "]", f"not imported: [{missing}"
