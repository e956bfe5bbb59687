"""Settings given in the forms users write them: any case of ``auto``, the ``DD:HH:MM:SS`` form in the
environment too, and errors that name the bad key or argument."""

from datetime import timedelta

import pytest

from fault_tolerant_handlers import start_watchdog
from fault_tolerant_handlers.core import config


@pytest.mark.parametrize("value", ["auto", "AUTO", "Auto", " auto "])
def test_hang_timeout_auto_in_any_case_is_the_learned_deadline(value):
    assert config.check_hang_timeout(value) == config.AUTO


def test_a_dict_duration_with_an_unknown_key_names_the_key_and_the_valid_ones():
    with pytest.raises(TypeError, match=r"^hang_timeout must be .*; unknown key\(s\) 'minute' \(the keys are weeks, days, hours, minutes"):
        config.check_hang_timeout({"minute": 5})
    with pytest.raises(TypeError, match=r"^join_timeout must be .*; unknown key\(s\) 'secs'"):
        config.check_join_timeout({"secs": 5})
    assert config.check_hang_timeout({"minutes": 5}) == timedelta(minutes=5)


def test_the_environment_takes_dd_hh_mm_ss_like_the_argument(monkeypatch):
    monkeypatch.setenv(config.HANG_TIMEOUT_ENV, "00:00:05:00")
    assert config.load().hang_timeout == timedelta(minutes=5)
    monkeypatch.setenv(config.HANG_TIMEOUT_ENV, "AUTO")
    assert config.load().hang_timeout == config.AUTO
    monkeypatch.setenv(config.HANG_TIMEOUT_ENV, "08:00:00:00")  # 8 days: over the 7-day limit
    with pytest.raises(ValueError, match="FTH_HANG_TIMEOUT_SEC='08:00:00:00'"):
        config.load().hang_timeout


def test_start_watchdog_errors_name_the_call():
    with pytest.raises(TypeError, match=r"start_watchdog\(hang_timeout=\.\.\.\) must be"):
        start_watchdog(hang_timeout="5m")
    with pytest.raises(TypeError, match=r"start_watchdog\(group=1\): expected None .* torch.distributed.ProcessGroup"):
        start_watchdog(group=1)
