"""``bench/autohang.py``'s first table drives the real ``Guard.beat`` and ``Watchdog.beat``: a change of
either's signature breaks it here, not in a measurement. No timing targets here: those are the bench's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "autohang.py"


def test_the_mark_cost_runs_the_adapters_beat_through_the_watchdogs():
    spec = importlib.util.spec_from_file_location("bench_autohang", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.mark_cost(calls=10, repeats=1)
    assert len(rows) == 5 and rows[-1].startswith("| beat(step, 'step'): hang_timeout='auto' | "), rows
