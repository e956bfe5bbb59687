"""SafeDiskSaver: a checkpoint write that dies never costs an earlier checkpoint (stock Ignite's can).

Ignite's ``Checkpoint`` removes the oldest kept file before writing the new one. A write that dies
(here: the object being saved raises inside ``torch.save``, at the moment a kill would strike) then
leaves stock ``DiskSaver`` with no complete checkpoint at all when ``n_saved=1``.
"""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver

from fault_tolerant_handlers import latest_checkpoint
from fault_tolerant_handlers.ignite import SafeDiskSaver


class DiesOnSave:
    """A to_save object whose state_dict cannot be written at iteration ``at``."""

    def __init__(self, engine: Engine, at: int) -> None:
        self.engine, self.at = engine, at

    def state_dict(self):
        if self.engine.state.iteration == self.at:
            return {"x": Unpicklable()}
        return {"x": torch.tensor(float(self.engine.state.iteration))}

    def load_state_dict(self, state) -> None:
        pass


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("killed during the write")


def run(saver_cls, tmp_path):
    trainer = Engine(lambda e, b: None)
    to_save = {"trainer": trainer, "probe": DiesOnSave(trainer, at=6)}
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2),
                              Checkpoint(to_save, saver_cls(str(tmp_path), require_empty=False), n_saved=1,
                                         global_step_transform=lambda e, _: e.state.iteration))
    with pytest.raises(RuntimeError, match="killed during the write"):
        trainer.run(range(10), max_epochs=1)
    return sorted(p.name for p in tmp_path.iterdir())


def test_stock_disksaver_loses_the_only_checkpoint(tmp_path):
    assert run(DiskSaver, tmp_path) == []  # checkpoint_4.pt removed before checkpoint_6.pt failed
    assert latest_checkpoint(tmp_path) is None


def test_safe_disksaver_keeps_it(tmp_path):
    assert run(SafeDiskSaver, tmp_path) == ["checkpoint_4.pt"]
    path = latest_checkpoint(tmp_path)
    assert torch.load(path, weights_only=True)["trainer"]["iteration"] == 4


def test_safe_disksaver_still_keeps_n_saved(tmp_path):
    trainer = Engine(lambda e, b: None)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2),
                              Checkpoint({"trainer": trainer}, SafeDiskSaver(str(tmp_path), require_empty=False),
                                         n_saved=2, global_step_transform=lambda e, _: e.state.iteration))
    trainer.run(range(10), max_epochs=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer_10.pt", "trainer_8.pt"]  # one object: named after it
