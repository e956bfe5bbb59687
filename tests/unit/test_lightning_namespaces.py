"""The Lightning callback with either namespace: ``lightning.pytorch`` (the ``lightning`` package)
and ``pytorch_lightning`` (the standalone ``pytorch-lightning`` package), two copies of the same
code with distinct classes. Each case runs in a fresh interpreter: which namespaces are imported
first decides the callback's bases. (A real 2-rank ``pytorch_lightning.Trainer`` run:
``tests/distributed/test_readme_lightning.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from launch import ROOT

pytest.importorskip("pytorch_lightning")


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.timeout(300)
def test_standalone_pytorch_lightning_only():
    out = _run("""
        import sys
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import ModelCheckpoint, OnExceptionCheckpoint
        from fault_tolerant_handlers import _compat_lightning
        from fault_tolerant_handlers.lightning import FaultTolerance

        assert "lightning.pytorch" not in sys.modules, "the other namespace was imported"
        cb = FaultTolerance()
        assert isinstance(cb, pl.Callback)
        # what the callback looks up at run time is pytorch_lightning's
        assert _compat_lightning.checkpoint_types() == (pl.callbacks.Checkpoint,)
        assert isinstance(ModelCheckpoint(), _compat_lightning.checkpoint_types())
        assert isinstance(OnExceptionCheckpoint("x"), _compat_lightning.checkpoint_types())
        spawn = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=cb, logger=False)
        assert cb in spawn.callbacks  # a single callback, not a list: Lightning checks isinstance
        ddp = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[FaultTolerance()], logger=False)
        for trainer in (spawn, ddp):
            assert _compat_lightning.namespace(trainer) == "pytorch_lightning"
            _compat_lightning.check(trainer)
        assert _compat_lightning.on_exception_runs_in_rank(spawn) is False
        assert _compat_lightning.on_exception_runs_in_rank(ddp) is True
        print("ok")
    """)
    assert out.strip().endswith("ok")


@pytest.mark.timeout(300)
def test_both_namespaces_imported_first_and_lightning_by_default():
    out = _run("""
        import lightning.pytorch as lp
        import pytorch_lightning as ptl
        from fault_tolerant_handlers import _compat_lightning
        from fault_tolerant_handlers.lightning import FaultTolerance

        cb = FaultTolerance()
        assert isinstance(cb, lp.Callback) and isinstance(cb, ptl.Callback)
        assert set(_compat_lightning.checkpoint_types()) == {lp.callbacks.Checkpoint, ptl.callbacks.Checkpoint}
        for pl in (lp, ptl):
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=cb, logger=False)
            assert _compat_lightning.namespace(trainer) == pl.__name__
            assert _compat_lightning.on_exception_runs_in_rank(trainer) is False
        print("ok")
    """)
    assert out.strip().endswith("ok")
    out = _run("""
        import sys
        from fault_tolerant_handlers.lightning import FaultTolerance  # nothing of Lightning imported yet
        import lightning.pytorch as lp
        assert isinstance(FaultTolerance(), lp.Callback)
        print("ok")
    """)
    assert out.strip().endswith("ok")
