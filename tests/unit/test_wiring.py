"""The package is assembled in one table (``fault_tolerant_handlers/wiring.py``): after the package
is imported, every hook holds exactly the table's callbacks in the table's order; no module adds to a
hook when it is imported; only the recovery (for the process it runs in) and ``on_recovery`` add to
a hook outside the table; and docs/architecture.md lists the same callbacks in the same order."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import fault_tolerant_handlers
from fault_tolerant_handlers import wiring
from fault_tolerant_handlers.core import hooks

PACKAGE = Path(fault_tolerant_handlers.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

#: The only places outside the table that add to a hook, each for the process it runs in:
#: ``(module, function)``.
WHILE_RUNNING = {
    ("recover/inplace.py", "_install_interrupter"),  # INTERRUPT, while recover_in_place runs
    ("recover/inplace.py", "_restore_interrupter"),  # and removed when it ends
    ("recover/keeper.py", "_child"),  # LOSE and the keeper's SESSION_STARTED, in a keeper's training child
    ("recover/keeper.py", "run"),  # KEEPER_PID, in the child just forked
    ("core/recoveries.py", "on_recovery"),  # a user's callback
    ("core/recoveries.py", "unsubscribe"),  # and its removal
}


def _name(callback) -> str:
    return getattr(callback, "__qualname__", repr(callback))


def _documented_name(callback) -> str:
    """``<module>.<name>`` as the docs write it (``reports.write_failed``; ``lightning._hook``)."""
    module = callback.__module__
    return _name(callback) if module == wiring.__name__ else f"{module.rsplit('.', 1)[-1]}.{_name(callback)}"


def test_after_import_every_hook_holds_the_table_in_its_order():
    """In a fresh interpreter (the frameworks' adapters imported too): nothing else is registered."""
    code = ("import json, fault_tolerant_handlers, fault_tolerant_handlers.ignite, fault_tolerant_handlers.lightning\n"
            "from fault_tolerant_handlers.core import hooks\n"
            "print(json.dumps({h: [[getattr(c, '__module__', ''), getattr(c, '__qualname__', repr(c)), t]"
            " for c, t in hooks._hooks[h]] for h in hooks.HOOKS}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent, check=True).stdout
    registered = json.loads(out.strip().splitlines()[-1])
    expected = {hook: [] for hook in hooks.HOOKS}
    for hook, callback, *tolerate in wiring.WIRING:
        expected[hook].append([callback.__module__, _name(callback), bool(tolerate)])
    assert registered == expected


def test_the_table_is_grouped_in_the_hooks_order_and_every_step_has_a_step():
    order = [hooks.HOOKS.index(hook) for hook, *_ in wiring.WIRING]
    assert order == sorted(order), "the table lists the hooks in core/hooks.py's order"
    assert {hook for hook, *_ in wiring.WIRING} >= set(hooks.STEPS) | {hooks.WORLD, hooks.WATCHDOG, hooks.DEFER}
    assert all(flag is wiring.TOLERATE for _, _, *flags in wiring.WIRING for flag in flags)
    assert all(hooks.callbacks(hook) for hook in hooks.STEPS)


def _hook_calls(tree: ast.AST):
    """``(function or None, call)`` of every ``hooks.add``/``hooks.remove`` call (None: module level)."""
    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in ("add", "remove") and isinstance(child.func.value, ast.Name)
                    and child.func.value.id == "hooks"):
                yield function, child
            yield from visit(child, inner)
    yield from visit(tree, None)


def test_no_module_adds_to_a_hook_when_imported_and_only_the_recovery_outside_the_table():
    at_import, elsewhere = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in ("wiring.py", "core/hooks.py"):
            continue
        for function, call in _hook_calls(ast.parse(path.read_text(), relative)):
            if function is None:
                at_import.append(f"{relative}:{call.lineno}")
            else:
                elsewhere.add((relative, function))
    assert at_import == []
    assert elsewhere == WHILE_RUNNING


def test_the_architecture_lists_the_wiring_in_its_order():
    """docs/architecture.md's table "The wiring" names every callback of the table, in order."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("| hook | callbacks, in order |"):]
    section = section[:section.index("\n\n")]
    documented = []
    for row in section.splitlines()[2:]:
        hook_cell, callbacks_cell = row.strip("|").split("|")[:2]
        for hook in re.findall(r"`([A-Z_]+)`", hook_cell):
            documented += [(getattr(hooks, hook), name) for name in re.findall(r"`([\w.]+)`", callbacks_cell)]
    assert documented == [(hook, _documented_name(callback)) for hook, callback, *_ in wiring.WIRING]
