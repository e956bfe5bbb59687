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
        sys.modules["lightning"] = None  # as if only the pytorch-lightning distribution were installed
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import ModelCheckpoint, OnExceptionCheckpoint
        from fault_tolerant_handlers.adapters import compat_lightning as _compat_lightning
        from fault_tolerant_handlers.lightning import FaultTolerance

        assert _compat_lightning.NAMESPACES == ("pytorch_lightning",)
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


_FIT = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Model(lp.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = lp.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[FaultTolerance()])
    trainer.fit(Model(), data)
    assert trainer.global_step == 2
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("first", ["pytorch_lightning", "fault_tolerant_handlers"])
def test_both_installed_the_callback_is_each_ones_whatever_the_import_order(first):
    """With ``pytorch_lightning`` imported before a ``lightning.pytorch`` Trainer is used (by a
    library, a test module's import), lightning 2.5's ``is_overridden`` needs the callback to be a
    ``lightning.pytorch`` ``Callback`` ("ValueError: Expected a parent" otherwise)."""
    imports = ("import pytorch_lightning as ptl\nfrom fault_tolerant_handlers.lightning import FaultTolerance\n"
               "import lightning.pytorch as lp\n") if first == "pytorch_lightning" else (
               "from fault_tolerant_handlers.lightning import FaultTolerance\nimport lightning.pytorch as lp\n"
               "import pytorch_lightning as ptl\n")
    out = _run(imports + textwrap.dedent("""
        from fault_tolerant_handlers.adapters import compat_lightning as _compat_lightning

        cb = FaultTolerance()
        assert isinstance(cb, lp.Callback) and isinstance(cb, ptl.Callback)
        assert set(_compat_lightning.checkpoint_types()) == {lp.callbacks.Checkpoint, ptl.callbacks.Checkpoint}
        for pl in (lp, ptl):
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=cb, logger=False)
            assert _compat_lightning.namespace(trainer) == pl.__name__
            assert _compat_lightning.on_exception_runs_in_rank(trainer) is False
    """) + textwrap.dedent(_FIT) + "print('ok')\n")
    assert out.strip().endswith("ok")
