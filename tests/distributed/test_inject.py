"""``FTH_INJECT``: parsing (bad specs name the accepted forms) and real injected faults in an
Ignite run on 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_tolerant_handlers.core.inject import FORMS, Injection, Injector, InjectedFault, parse
from launch import PROGRAMS, run_ranks

IGNITE = PROGRAMS / "ignite_main.py"


def test_parse_accepted_forms():
    assert parse("raise@rank=1,iteration=5") == [Injection("raise", 1, 5)]
    assert parse(" kill @ rank=0, iteration=20 ,epoch=2 ; worker-kill@rank=1,iteration=3") == [
        Injection("kill", 0, 20, 2),
        Injection("worker-kill", 1, 3),
    ]
    assert parse("") == []
    assert str(Injection("hang", 1, 8, 2)) == "hang@rank=1,iteration=8,epoch=2"


@pytest.mark.parametrize(
    "spec, says",
    [
        ("explode@rank=1,iteration=5", "unknown kind 'explode'"),
        ("raise rank=1", "cannot read"),
        ("raise@rank=1", "iteration missing"),
        ("raise@iteration=3", "rank missing"),
        ("raise@rank=one,iteration=3", "rank='one'"),
        ("raise@rank=1,iteration=3,step=4", "unknown field 'step=4'"),
        ("raise@rank=1,rank=2,iteration=3", "rank given twice"),
        ("raise@rank=1,iteration=0", "iteration counts from 1"),
        ("raise@rank=-1,iteration=3", "rank='-1'"),
    ],
)
def test_bad_specs_name_the_accepted_forms(spec, says):
    with pytest.raises(ValueError) as info:
        parse(spec)
    assert says in str(info.value)
    assert FORMS in str(info.value)
    assert "raise, kill, hang, worker-kill" in str(info.value)


def test_attempt_field_default_first_attempt_only(monkeypatch):
    assert parse("raise@rank=1,iteration=5,attempt=2") == [Injection("raise", 1, 5, None, 2)]
    assert parse("kill@rank=1,iteration=5,attempt=any")[0].attempt is None
    assert str(parse("kill@rank=1,iteration=5,attempt=any")[0]) == "kill@rank=1,iteration=5,attempt=any"
    with pytest.raises(ValueError, match="attempt='first'"):
        parse("raise@rank=1,iteration=5,attempt=first")
    spec = "raise@rank=1,iteration=5; kill@rank=0,iteration=7,attempt=1; hang@rank=1,iteration=9,attempt=any"
    monkeypatch.setenv("FTH_INJECT", spec)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert [i.kind for i in Injector.from_env().pending] == ["raise", "hang"]  # not torchrun: attempt 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert [i.kind for i in Injector.from_env().pending] == ["raise", "hang"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert [i.kind for i in Injector.from_env().pending] == ["kill", "hang"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert [i.kind for i in Injector.from_env().pending] == ["hang"]


def test_injector_fires_once_on_the_matching_rank_and_iteration():
    injector = Injector(parse("raise@rank=1,iteration=2,epoch=1"))
    injector.maybe_fire(0, 2, 1)  # other rank
    injector.maybe_fire(1, 2, 2)  # other epoch
    with pytest.raises(InjectedFault, match="injected by FTH_INJECT: raise@rank=1,iteration=2,epoch=1"):
        injector.maybe_fire(1, 2, 1)
    injector.maybe_fire(1, 2, 1)  # fired already


@pytest.mark.timeout(120)
def test_injected_raise_fails_every_rank_of_an_ignite_run(tmp_path):
    results = run_ranks(2, "", tmp_path, script=IGNITE, deadline=60,
                        env=dict(FAULT="none", FTH_INJECT="raise@rank=1,iteration=4"))
    assert results[1].event("run_raised")["raised"] == "InjectedFault"
    peer = results[0].event("run_raised")
    assert peer["raised"] == "PeerFailedError" and peer["failed_rank"] == 1
    assert peer["exc_type"] == "fault_tolerant_handlers.inject.InjectedFault"
    assert peer["step"] == 4
    assert "raise@rank=1,iteration=4" in peer["exc_message"]


@pytest.mark.timeout(120)
def test_injected_worker_kill_is_survived_by_a_restartable_loader(tmp_path):
    results = run_ranks(2, "", tmp_path, script=IGNITE, deadline=90,
                        env=dict(FAULT="none", WORKERS="2", RESTARTABLE="1",
                                 FTH_INJECT="worker-kill@rank=1,iteration=3"))
    for r in results:
        done = r.event("run_returned")
        assert done["epoch"] == 3
    assert results[1].event("run_returned")["dataloader_restarts"] == 1
    assert results[0].event("run_returned")["dataloader_restarts"] == 0
    assert "worker-kill@rank=1,iteration=3" in results[1].stderr


# -- loops of your own: fail_together(step=...) and inject.step ----------------------------------------


@pytest.fixture
def plain_injector(monkeypatch):
    """A fresh process injector for loops of your own, whose end-of-job check is not registered here."""
    from fault_tolerant_handlers.core import inject as core_inject

    monkeypatch.setattr(core_inject, "_plain", None)
    monkeypatch.setattr(core_inject, "_exit_check", [-1])  # registered already (for no rank): not in pytest's atexit
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    return monkeypatch


def test_a_section_given_its_step_fires_the_injection_as_it_begins(plain_injector):
    from fault_tolerant_handlers import fail_together

    plain_injector.setenv("FTH_INJECT", "raise@rank=0,iteration=3,epoch=1")
    entered = []
    with pytest.raises(InjectedFault, match="raise@rank=0,iteration=3,epoch=1"):
        for epoch in (0, 1):
            for step in range(1, 5):
                with fail_together("step", step=step, epoch=epoch):
                    entered.append((epoch, step))
    assert entered == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)]  # the section of (1, 3) did not run


def test_inject_step_fires_in_a_loop_with_one_section_per_epoch(plain_injector):
    from fault_tolerant_handlers import fail_together, inject

    plain_injector.setenv("FTH_INJECT", "raise@rank=0,iteration=5")
    done = []
    with pytest.raises(InjectedFault, match="raise@rank=0,iteration=5"):
        with fail_together("train", epoch=0):
            for step in range(1, 9):
                inject.step(step, 0)
                done.append(step)
    assert done == [1, 2, 3, 4]
    inject.step(5, 0)  # fired once already
    with pytest.raises(TypeError, match=r"inject.step\(iteration=...\) must be an int >= 0, got -1"):
        inject.step(-1)
    with pytest.raises(TypeError, match=r"inject.step\(epoch=...\) must be an int >= 0 or None, got 'x'"):
        inject.step(1, "x")
    plain_injector.delenv("FTH_INJECT")
    inject.step(5)  # not set: nothing


_NEVER_TOLD = """
from fault_tolerant_handlers import fail_together, inject
for epoch in range(3):
    with fail_together("train", epoch=epoch):
        {body}
print("done")
"""


@pytest.mark.parametrize("body, warned", [("pass", True), ("inject.step(epoch + 1, epoch)", False)])
def test_an_injection_nothing_could_fire_is_named_at_exit(body, warned):
    """A loop whose sections have no step and that never calls inject.step: the rank the injection
    targets says at exit that nothing fired, and which lines fire it (before: silence)."""
    import os
    import subprocess
    import sys

    from launch import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
    env.update(PYTHONPATH=str(ROOT), FTH_INJECT="raise@rank=0,iteration=7")
    proc = subprocess.run([sys.executable, "-c", _NEVER_TOLD.format(body=body)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    said = ("FTH_INJECT=raise@rank=0,iteration=7: nothing fired on rank 0: nothing in this job told the library its "
            "iteration" in proc.stderr)
    assert said == warned, proc.stderr[-3000:]
    if warned:
        assert "fail_together(name, step=N)" in proc.stderr and "inject.step(N)" in proc.stderr


@pytest.mark.timeout(120)
def test_an_injected_raise_fails_every_rank_of_a_loop_of_step_sections(tmp_path):
    """2 real ranks, one fail_together section per step given its step: rank 1's section of step 4
    raises InjectedFault as it begins, and rank 0 raises PeerFailedError naming it, in that section."""
    from launch import run_ranks

    results = run_ranks(2, "step_sections", tmp_path, deadline=60, env={"FTH_INJECT": "raise@rank=1,iteration=4"})
    mine, peer = results[1].event("loop"), results[0].event("loop")
    assert mine["raised"] == "InjectedFault", results[1].stderr[-3000:]
    assert peer["raised"] == "PeerFailedError" and peer["failed_rank"] == 1 and peer["exc_type"].endswith("InjectedFault")
    assert "'step'" in peer["where"] and "4" in peer["where"], peer["where"]
    assert max(e["step"] for e in results[0].events if e["event"] == "step") == 4
