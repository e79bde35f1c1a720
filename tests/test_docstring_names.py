"""Every ``module.name`` a docstring names in backticks resolves to something that exists, so a
docstring cannot keep naming a function or module from before a move."""

import ast
import contextlib
import importlib
import re
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ("switchboard", "todos", "ingest", "endpoints", "channels_push", "console", "accounts")
# ``a.b`` or ``a.b.c()`` in single or double backticks: a dotted Python name.
DOTTED = re.compile(r"``?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``?")
# Dotted names that are not Python: file names a docstring mentions.
NOT_PYTHON = re.compile(r"\.(py|md|html|js|css|txt|toml|ini|conf|json|sh|svg|sqlite3)$")


def shipped_modules():
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "tests" in parts or "migrations" in parts or parts[-1] in ("conftest",
                                                                           "settings_test"):
                continue
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield text


def walk(value, names) -> bool:
    for name in names:
        if hasattr(value, name):
            value = getattr(value, name)
            continue
        if not hasattr(value, "__path__"):
            return False
        try:
            value = importlib.import_module(f"{value.__name__}.{name}")
        except ImportError:
            return False
    return True


def modules_named(first: str, module_name: str, module) -> list:
    """Every module ``first`` may name in ``module``'s docstrings: one it imports under that
    name, a module of its package or of a package above, a top-level one, or a shipped module
    of that name anywhere (``publish`` for ``channels_push.bus.publish``). Empty when ``first``
    names no module (an instance's attribute, a payload field, a group name)."""
    value = getattr(module, first, None)
    if value is not None:
        return [value] if isinstance(value, types.ModuleType) else []
    found = []
    package = module_name if hasattr(module, "__path__") else module_name.rpartition(".")[0]
    while True:
        with contextlib.suppress(ImportError):
            found.append(importlib.import_module(f"{package}.{first}" if package else first))
        if not package:
            break
        package = package.rpartition(".")[0]
    found += [importlib.import_module(name) for name, _ in shipped_modules()
              if name.rpartition(".")[2] == first]
    return found


def resolves(dotted: str, module_name: str, module) -> bool:
    """Whether ``dotted``, when it starts with a module, names something in one of them."""
    first, *rest = dotted.split(".")
    bases = modules_named(first, module_name, module)
    return not bases or any(walk(base, rest) for base in bases)


def unresolved_names() -> list[str]:
    found = []
    for module_name, path in shipped_modules():
        module = importlib.import_module(module_name)
        for text in docstrings(path):
            for dotted in DOTTED.findall(text):
                if NOT_PYTHON.search(dotted) or resolves(dotted, module_name, module):
                    continue
                found.append(f"{path.relative_to(ROOT)}: ``{dotted}``")
    return found


def test_every_dotted_name_in_a_docstring_resolves():
    assert unresolved_names() == []


def test_a_name_from_before_a_move_is_found():
    ring_budget = importlib.import_module("todos.ring_budget")
    assert resolves("statements.fetch_todos", "todos.ring_budget", ring_budget)
    assert resolves("ring_budget.charge_ring", "todos.ring_budget", ring_budget)
    assert not resolves("transitions.charge_ring", "todos.ring_budget", ring_budget)
    assert not resolves("todos.views.board", "todos.ring_budget", ring_budget)
    # Not a module: an instance's attribute is no claim about the code's layout.
    assert resolves("endpoint.credential_id", "todos.ring_budget", ring_budget)
