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
