"""The process layer imports one way: no circle among its modules, none hidden in a function.

Read from the source (ast), not by importing it: a circle that Python resolves at run time
(an import inside a function) is what this guards against.
"""

from __future__ import annotations

import ast
from pathlib import Path

import areal_cli

PKG = Path(areal_cli.__file__).parent

# Bottom to top; each may import only modules before it in this list.
LAYERS = [
    "procs",
    "components",
    "supervisor",
    "reconcile",
    "policy",
    "probes",
    "readdress",
    "guard",
    "launcher",
    "watchdog",
    "service_run",
    "service_logs",
    "lifecycle",
]


def _imports(name: str, pkg: Path = PKG) -> list[tuple[str, bool]]:
    """(process-layer module imported, whether the import is inside a function) of `name`."""
    tree = ast.parse((pkg / f"{name}.py").read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module:
                if child.module == "areal_cli":
                    targets = [f"areal_cli.{a.name}" for a in child.names]
                else:
                    targets = [child.module]
            for t in targets:
                mod = t.removeprefix("areal_cli.")
                if t.startswith("areal_cli.") and mod in LAYERS:
                    found.append((mod, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def test_every_layer_module_exists():
    assert [n for n in LAYERS if not (PKG / f"{n}.py").is_file()] == []


def test_process_layer_imports_only_downwards():
    upward = [
        f"{name} imports {mod}"
        for i, name in enumerate(LAYERS)
        for mod, _ in _imports(name)
        if mod not in LAYERS[:i]
    ]
    assert upward == []


def test_process_layer_hides_no_import_in_a_function():
    hidden = [
        f"{name} imports {mod} inside a function"
        for name in LAYERS
        for mod, in_function in _imports(name)
        if in_function
    ]
    assert hidden == []


def test_the_check_sees_an_upward_and_a_hidden_import(tmp_path):
    """What the checks above look for is found: a module-level import of a module above,
    and an import inside a function."""
    (tmp_path / "supervisor.py").write_text(
        "from areal_cli import lifecycle\n\n\n"
        "def f():\n    from areal_cli.watchdog import Watchdog\n"
    )
    assert _imports("supervisor", tmp_path) == [("lifecycle", False), ("watchdog", True)]
