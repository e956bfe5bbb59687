"""The README and the docs/ pages say what the code does.

* every ``python`` block compiles;
* every quoted error message (a ``text`` block after ``<!-- error: LABEL -->``) is, word for word,
  what the library raises for LABEL: each label is mapped below to the call that raises it, and a
  label without a mapping fails, so no quoted message goes unchecked;
* a docs page's copy of a README quick start (``<!-- same-as-readme: NAME -->``) is the README's,
  which ``tests/distributed/test_readme_*.py`` run as printed;
* blocks marked ``<!-- snippet: NAME -->`` in docs/ run (a fresh interpreter each) and exit 0, but
  those that fail on purpose, which a test of their own runs (``RUN_ELSEWHERE``);
* relative links in docs/ lead to a file and, with ``#anchor``, to a heading of it; the README,
  which is also the package's long description on a package index, has no relative link or image.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from launch import ROOT, readme_snippet

DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
ERROR = re.compile(r"<!-- error: (.*?) -->\s*```text\n(.*?)\n```", re.S)
SAME = re.compile(r"<!-- same-as-readme: (\S+) -->\s*```python\n(.*?)```", re.S)
SNIPPET = re.compile(r"<!-- snippet: (\S+) -->\s*```python\n(.*?)```", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(pattern):
    return [pytest.param(page, *m.groups(), id=f"{page.name}:{m.group(1)[:40]}")
            for page in PAGES for m in pattern.finditer(page.read_text())]


def _python_blocks():
    return [pytest.param(page, m.group(1), id=f"{page.name}:{page.read_text()[:m.start()].count(chr(10)) + 1}")
            for page in PAGES for m in BLOCK.finditer(page.read_text())]


@pytest.mark.parametrize("page, code", _python_blocks())
def test_python_blocks_compile(page, code):
    compile(code, str(page), "exec")


# -- quoted error messages ------------------------------------------------------------------------
def _one_rank_first_rank_2_on_2_ranks(monkeypatch):
    from fault_tolerant_handlers.core import sections

    sections._check_rank(2, False, 2)  # what one_rank_first(rank=2) runs once it knows the world size


def _ignite_ft(**kwargs):
    from fault_tolerant_handlers.ignite import FaultTolerance

    return FaultTolerance(**kwargs)


def _lightning_ft(**kwargs):
    from fault_tolerant_handlers.lightning import FaultTolerance

    return FaultTolerance(**kwargs)


def _env(name, value):
    def call(monkeypatch):
        from fault_tolerant_handlers.core import config

        monkeypatch.setenv(name, value)
        config.load()
    return call


def _fail_together_step(monkeypatch):
    from fault_tolerant_handlers import fail_together

    fail_together("x", step="3")


def _one_rank_first_rank_str(monkeypatch):
    from fault_tolerant_handlers import one_rank_first

    one_rank_first(rank="0")


def _recover_join_auto(monkeypatch):
    from fault_tolerant_handlers import recover_in_place

    recover_in_place(print, join_timeout="auto")


#: label in the docs -> the calls that must raise exactly the quoted text (each adapter, where both take it)
ERRORS = {
    "one_rank_first(rank=2) on 2 ranks": [_one_rank_first_rank_2_on_2_ranks],
    'one_rank_first(rank="0")': [_one_rank_first_rank_str],
    'FaultTolerance(hang_timeout="5m")': [lambda mp: _ignite_ft(hang_timeout="5m"), lambda mp: _lightning_ft(hang_timeout="5m")],
    "FaultTolerance(hang_timeout=0.5)": [lambda mp: _ignite_ft(hang_timeout=0.5), lambda mp: _lightning_ft(hang_timeout=0.5)],
    'FaultTolerance(name="")': [lambda mp: _ignite_ft(name=""), lambda mp: _lightning_ft(name="")],
    'fail_together("x", step="3")': [_fail_together_step],
    "FTH_EXIT_GRACE_SEC=nan": [_env("FTH_EXIT_GRACE_SEC", "nan")],
    'recover_in_place(join_timeout="auto")': [_recover_join_auto],
    "FTH_INJECT=explode@rank=1,iteration=5": [_env("FTH_INJECT", "explode@rank=1,iteration=5")],
}


@pytest.mark.parametrize("page, label, quoted", _blocks(ERROR))
def test_quoted_error_is_the_real_one(page, label, quoted, monkeypatch):
    for key in [k for k in os.environ if k.startswith("FTH_")]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert label in ERRORS, f"{page.name} quotes an error for {label!r}: add the call that raises it to ERRORS"
    for call in ERRORS[label]:
        with pytest.raises(Exception) as err:
            call(monkeypatch)
        assert f"{err.type.__name__}: {err.value}" == quoted.strip()


def test_every_mapped_error_is_quoted_somewhere():
    quoted = {label for _, label, _ in (p.values for p in _blocks(ERROR))}
    assert set(ERRORS) <= quoted, set(ERRORS) - quoted


def test_the_hang_timeout_forms_the_docs_name_are_accepted():
    from fault_tolerant_handlers.core import config

    assert config.check_hang_timeout(300) == config.check_hang_timeout("00:00:05:00") == \
        config.check_hang_timeout({"minutes": 5}) == timedelta(minutes=5)


# -- copies, runnable snippets, links ---------------------------------------------------------------
@pytest.mark.parametrize("page, name, code", _blocks(SAME))
def test_docs_copy_of_a_readme_quick_start_is_the_readme_s(page, name, code):
    assert code == readme_snippet(name)


#: docs snippets that fail on purpose, run (with their expected output) by a test of their own
RUN_ELSEWHERE = {"fabric": "tests/distributed/test_fabric_recipe.py",
                 # under torchrun (a relaunch), by the same file
                 "plain-checkpoint": "tests/distributed/test_fabric_recipe.py",
                 "fabric-checkpoint": "tests/distributed/test_fabric_recipe.py"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page, name, code", [p for p in _blocks(SNIPPET)
                                              if p.values[0].parent.name == "docs" and p.values[1] not in RUN_ELSEWHERE])
def test_docs_snippet_runs(page, name, code, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTH_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_relative_links_in_docs_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target} (no such file)"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: link to {target} (no such heading in {dest.name})"


def test_readme_is_a_safe_long_description():
    text = (ROOT / "README.md").read_text()
    relative = [t for t in LINK.findall(text) if not re.match(r"https?://", t)]
    assert not relative, f"relative links break on a package index: {relative}"
    assert "![" not in text
    assert len(text.splitlines()) <= 270
