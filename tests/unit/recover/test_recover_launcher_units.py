"""``recover_in_place`` and the launchers, in one process: what it returns pickles (spawning
launchers pickle the function they run in each rank), a process it starts knows it runs inside its
parent's recovery, and Lightning ``ddp``'s rank 0 keeps the variable that stops the next attempt's
``Trainer`` from starting the other ranks again."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys

import pytest

from fault_tolerant_handlers import recover_in_place
from fault_tolerant_handlers.core import attempts

pytestmark = pytest.mark.timeout(60)


def train(x: int) -> int:
    return x * 2


@recover_in_place(max_restarts=1)
def decorated(x: int) -> int:
    return x + 1


def test_an_inline_recovery_pickles_as_its_function_and_settings():
    wrapped = recover_in_place(train, max_restarts=2)
    back = pickle.loads(pickle.dumps(wrapped))
    assert back.fn is train and back.max_restarts == 2 and back.join_timeout == wrapped.join_timeout
    assert back(3) == 6  # no process group: the function runs once
    assert wrapped.__wrapped__ is train and wrapped.__name__ == "train"


def test_a_decorated_recovery_pickles_by_its_name():
    assert pickle.loads(pickle.dumps(decorated)) is decorated
    assert decorated(4) == 5


def test_a_local_function_does_not_pickle_as_it_never_did():
    def local(x):
        return x

    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(recover_in_place(local))


def _report(conn) -> None:
    conn.send((attempts.recovering(), attempts.spawned_by_recovery(), os.getppid()))
    conn.close()


def test_a_child_of_a_recovery_knows_it_when_it_runs_none_itself():
    """A forked child inherits the module's state and the environment: it is not recovering (the pid
    is its parent's), and names its parent; a child started after the recovery ended does not."""
    assert attempts.spawned_by_recovery() is None and not attempts.recovering()
    ctx = multiprocessing.get_context("fork")
    previous = attempts.enter_recovery()
    try:
        assert attempts.recovering() and os.environ[attempts.RUNNING_ENV] == str(os.getpid())
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_report, args=(theirs,))
        child.start()
        recovering, parent, ppid = ours.recv()
        child.join(10)
        assert (recovering, parent, ppid) == (False, os.getpid(), os.getpid())
        code = "from fault_tolerant_handlers.core import attempts; print(attempts.spawned_by_recovery())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == str(os.getpid()), out.stderr[-2000:]
    finally:
        attempts.leave_recovery(previous)
    assert attempts.RUNNING_ENV not in os.environ and not attempts.recovering()
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_report, args=(theirs,))
    child.start()
    assert ours.recv()[:2] == (False, None)
    child.join(10)


@pytest.fixture
def no_launcher_env():
    """No launcher variables; and the environment as it was afterwards (Lightning's launcher writes
    LOCAL_RANK, WORLD_SIZE, MASTER_* into it)."""
    saved = dict(os.environ)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _ddp_trainer():
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)


def test_lightning_sets_local_rank_where_it_starts_the_ranks(no_launcher_env, monkeypatch):
    """What recovering in place under ``ddp`` relies on: the launcher that started the other ranks
    leaves ``LOCAL_RANK`` in its own environment, so a second Trainer starts none."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    started = []
    monkeypatch.setattr(subprocess_script.subprocess, "Popen", lambda cmd, env=None, cwd=None: started.append(env))
    trainer = _ddp_trainer()
    assert not trainer.strategy.cluster_environment.creates_processes_externally
    trainer.strategy.launcher._call_children_scripts()
    assert [env["LOCAL_RANK"] for env in started] == ["1"]
    assert os.environ["LOCAL_RANK"] == "0" and _ddp_trainer().strategy.cluster_environment.creates_processes_externally


def test_keep_launched_ranks_sets_local_rank_where_lightning_did_not(no_launcher_env):
    from fault_tolerant_handlers.adapters import compat_lightning

    trainer = _ddp_trainer()
    assert compat_lightning.keep_launched_ranks(trainer) is True
    assert os.environ["LOCAL_RANK"] == "0"
    assert compat_lightning.keep_launched_ranks(trainer) is False  # once is enough
    assert _ddp_trainer().strategy.cluster_environment.creates_processes_externally


def test_keep_launched_ranks_names_an_environment_that_would_start_them_again(no_launcher_env):
    from fault_tolerant_handlers.adapters import compat_lightning

    trainer = _ddp_trainer()
    environment = trainer.strategy.cluster_environment  # a LightningEnvironment, made to ignore LOCAL_RANK
    environment.__class__ = type("Stubborn", (type(environment),), {"creates_processes_externally": False})
    with pytest.raises(RuntimeError, match="Stubborn would start the other ranks again.*torchrun"):
        compat_lightning.keep_launched_ranks(trainer)


def test_a_recovery_error_inside_the_attempt_ends_the_job():
    """The attempt found recovering in place cannot work (e.g. Lightning would start the ranks again):
    no rank recovers."""
    from fault_tolerant_handlers.core.errors import RecoveryError
    from fault_tolerant_handlers.recover.agree import cause_of

    cause = cause_of(RecoveryError("the cluster environment Stubborn would start the other ranks again"), 0)
    assert cause.not_in_place.startswith("this rank found it cannot recover in place: the cluster environment")
