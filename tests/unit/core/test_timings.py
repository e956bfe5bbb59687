"""The one table of timings (``core/config.py``): its fixed values agree with each other, and a
setting that breaks a relation with them is named when a session starts."""

from __future__ import annotations

import logging
from datetime import timedelta

from fault_tolerant_handlers.core import config
from fault_tolerant_handlers.detect import liveness, watchdog
from fault_tolerant_handlers.launchers import reports, signals


def test_the_defaults_keep_every_relation(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("FTH_"):
            monkeypatch.delenv(name)
    assert config.check_timings(config.load()) == []
    assert config.check_timings() == []


def test_each_timing_is_defined_once_and_used_from_the_table():
    assert signals.CAUSE_LINGER is config.CAUSE_LINGER and signals.REACTION_WAIT is config.REACTION_WAIT
    assert reports.ZOMBIE_HOLD is config.ZOMBIE_HOLD and reports.SIGTERM_CAUSE_WAIT is config.SIGTERM_CAUSE_WAIT
    assert watchdog.RELEASE_GRACE is config.RELEASE_GRACE and watchdog.HEARTBEAT_EVERY is config.HEARTBEAT_EVERY
    assert liveness.HELPER_STORE_TIMEOUT is config.HELPER_STORE_TIMEOUT


def test_a_slow_poll_interval_is_named_at_start(monkeypatch, caplog):
    """CAUSE_LINGER is "the record grace and two polls": a 10 s poll breaks it (warned, not refused)."""
    monkeypatch.setenv(config.INTERVAL_ENV, "10")
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        cfg = config.load()
    assert cfg.interval == timedelta(seconds=10)
    problems = config.check_timings(cfg)
    assert any("FTH_WATCHDOG_INTERVAL_SEC=10" in p and "lingers 0.6 s" in p for p in problems), problems
    assert any("lingers 0.6 s" in r.getMessage() for r in caplog.records)


def test_contradicting_fixed_timings_are_a_bug(monkeypatch):
    monkeypatch.setattr(config, "SAME_DELIVERY", 1.0)
    try:
        config.check_timings()
    except AssertionError as err:
        assert "SAME_DELIVERY < CAUSE_LINGER" in str(err)
    else:
        raise AssertionError("not caught")


def test_a_configuration_warning_is_logged_once_per_process(monkeypatch, caplog):
    """Every session reads the configuration again (several loops, a recovery in place): its warnings
    are the process's, logged once (issue 46: the unknown variable was warned at every session)."""
    import logging

    monkeypatch.setenv("FTH_NOT_A_SETTING_46", "1")
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        for _ in range(3):
            config.load()
    assert caplog.text.count("ignoring unknown environment variable(s) FTH_NOT_A_SETTING_46") == 1, caplog.text
    monkeypatch.setenv("FTH_NOT_A_SETTING_46B", "1")  # another configuration: its own warning
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        config.load()
    assert "FTH_NOT_A_SETTING_46, FTH_NOT_A_SETTING_46B" in caplog.text
