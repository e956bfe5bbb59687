"""docs/reference.md lists every setting and every fixed timing as ``core/config.py`` defines them:
its two tables are made from the table and the timings themselves and must equal them.
``python tests/unit/core/test_settings_table.py`` writes them into the page after a change."""

from __future__ import annotations

import re
import sys
from datetime import timedelta
from pathlib import Path

from fault_tolerant_handlers.core import config

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "reference.md"
SETTINGS_HEAD = "| variable | default | accepted | meaning |\n|---|---|---|---|\n"
TIMINGS_HEAD = "| name | value | what it bounds |\n|---|---|---|\n"


def _number(value) -> str:
    return f"{value.total_seconds() if isinstance(value, timedelta) else value:.15g}"


def settings_table() -> str:
    rows = []
    for s in config.SETTINGS:
        if s.shown:
            default = s.shown
        elif s.kind == "choice":
            default = f"`{int(s.default) if isinstance(s.default, bool) else s.default}`"
        else:
            default = _number(s.default)
        accepted = {"choice": ", ".join(f"`{c}`" for c in s.choices), "inject": "see [rehearsing](rehearsing.md)"}.get(
            s.kind, f"{s.low:.15g}-{s.high:.15g}")
        accepted += {"hang": ", `auto`, `DD:HH:MM:SS`", "integer": " (an integer)"}.get(s.kind, "")
        rows.append(f"| `{s.variable}` | {default} | {accepted} | {s.meaning} |\n")
    return SETTINGS_HEAD + "".join(rows)


def timings_table() -> str:
    """One row per ``#:`` comment of config.py's fixed timings, with the constants it explains."""
    source = Path(config.__file__).read_text().split("# -- Fixed timings", 1)[1].split("\ndef ", 1)[0]
    rows, comment, names = [], [], []
    for line in source.splitlines() + [""]:
        assigned = re.match(r"([A-Z][A-Z_]+) = ", line)
        if assigned:
            names.append(assigned.group(1))
            continue
        if names:
            text = re.sub(r":\w+:`~?(?:\.*[\w]+\.)*([^`]+)`", r"`\1`", " ".join(comment)).replace("``", "`")
            values = ", ".join(_number(getattr(config, n)) + (" periods" if type(getattr(config, n)) is int else " s")
                               for n in names)
            rows.append(f"| {', '.join(f'`{n}`' for n in names)} | {values} | {text} |\n")
            comment, names = [], []
        if line.startswith("#:"):
            comment.append(line[2:].strip())
    return TIMINGS_HEAD + "".join(rows)


def _block(text: str, head: str) -> str:
    start = text.index(head)
    end = text.find("\n\n", start)
    return text[start:end + 1 if end >= 0 else len(text)]


def test_every_setting_is_in_the_reference_as_the_table_defines_it():
    assert _block(REFERENCE.read_text(), SETTINGS_HEAD) == settings_table(), \
        "run: python tests/unit/core/test_settings_table.py"
    assert len(config.SETTINGS) == 25 and len(config.KNOWN_ENV) == len(set(config.KNOWN_ENV))


def test_every_fixed_timing_is_in_the_reference_as_defined():
    table = timings_table()
    assert _block(REFERENCE.read_text(), TIMINGS_HEAD) == table, "run: python tests/unit/core/test_settings_table.py"
    for name in ("MAIN_STORE_TIMEOUT", "INTERRUPT_RESEND", "MAX_CHECK_HOLD", "WORKER_REAP", "STORE_HOST_CONNECT_TIMEOUT"):
        assert f"`{name}`" in table


def test_each_setting_is_read_once_per_environment(monkeypatch):
    first = config.settings()
    assert config.settings() is first
    monkeypatch.setenv(config.SPARE_WAIT_ENV, "7")
    assert config.settings().spare_wait == timedelta(seconds=7)


if __name__ == "__main__":
    text = REFERENCE.read_text()
    for head, table in ((SETTINGS_HEAD, settings_table()), (TIMINGS_HEAD, timings_table())):
        text = text.replace(_block(text, head), table) if head in text else text + "\n" + table
    REFERENCE.write_text(text)
    sys.exit(0)
