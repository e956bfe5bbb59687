"""The README's Lightning snippet, run as written: 2 CPU ranks with ``strategy="ddp"``, rank 1 raises
in ``training_step``; rank 0's ``trainer.fit`` raises ``PeerFailedError`` naming it, and the whole
job ends in seconds (the process-group timeout is Lightning's default, 30 minutes). The same snippet
also runs with ``import pytorch_lightning as L`` (the standalone ``pytorch-lightning`` package): its
``Trainer``, ``LightningModule`` and the callback's lookups are those of that namespace."""

from __future__ import annotations

import re

import pytest

from launch import readme_snippet, run_script

DEADLINE_SEC = 90


@pytest.mark.parametrize("namespace", ["lightning", "pytorch_lightning"])
def test_readme_snippet_fails_together(namespace, tmp_path):
    code = readme_snippet("lightning")
    if namespace == "pytorch_lightning":
        pytest.importorskip("pytorch_lightning")
        assert "import lightning as L\n" in code
        code = code.replace("import lightning as L\n", "import pytorch_lightning as L\n")
    script = tmp_path / "train.py"
    script.write_text(code)
    returncode, out, elapsed = run_script(script, deadline=DEADLINE_SEC)
    assert elapsed < DEADLINE_SEC, f"the snippet hung:\n{out[-3000:]}"
    assert "rank 0 stopped: rank 1 raised ValueError: bad sample 17 at step 4, epoch 0" in out, out[-4000:]
    assert re.search(r"^(\[rank1\]: )?ValueError: bad sample 17$", out, re.M), out[-4000:]  # rank 1: its own error
    assert returncode != 0
