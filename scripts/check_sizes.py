"""No module over 500 lines and no class over 300 in the packages' hand-written code, unless
scripts/size_allowlist.toml names it with a reason.

    uv run python scripts/check_sizes.py

A big module usually holds two jobs and a big class several; the allow-list says why each
one that is over is so today, and what would bring it under. An allow-listed entry that is
no longer over its limit fails too, so the list is kept true. Generated code (`*_pb2*`) is
not counted.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWLIST = ROOT / "scripts" / "size_allowlist.toml"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300


@dataclass(frozen=True)
class Oversize:
    name: str  # "path" or "path:Class", from the root
    lines: int
    limit: int


def measure(root: Path) -> list[Oversize]:
    """Every module and class over its limit under root's packages/*/src."""
    found: list[Oversize] = []
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        if "_pb2" in path.name:
            continue
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(Oversize(rel, lines, MAX_MODULE_LINES))
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found.append(Oversize(f"{rel}:{node.name}", size, MAX_CLASS_LINES))
    return found


def load_allowlist(path: Path) -> dict[str, str]:
    with path.open("rb") as f:
        doc = tomllib.load(f)
    allowed: dict[str, str] = {}
    for table in ("modules", "classes"):
        for name, reason in doc.get(table, {}).items():
            if not isinstance(reason, str) or not reason.strip():
                raise SystemExit(f"{path.name}: [{table}] {name!r} needs a reason (a string)")
            allowed[name] = reason
    return allowed


def problems(found: list[Oversize], allowed: dict[str, str]) -> list[str]:
    out = []
    over = {o.name for o in found}
    for o in found:
        if o.name not in allowed:
            kind = "class" if ":" in o.name else "module"
            out.append(
                f"{o.name}: {o.lines} lines, over the {kind} limit of {o.limit}; split it, or "
                f"add it to scripts/size_allowlist.toml with the reason it is so"
            )
    for name in sorted(set(allowed) - over):
        out.append(
            f"{name}: allow-listed but no longer over its limit; remove it from "
            f"scripts/size_allowlist.toml"
        )
    return out


def main() -> int:
    found = measure(ROOT)
    issues = problems(found, load_allowlist(ALLOWLIST))
    for line in issues:
        print(line)
    if not issues:
        print(
            f"--- sizes: no module over {MAX_MODULE_LINES} lines or class over "
            f"{MAX_CLASS_LINES} but the {len(found)} allow-listed"
        )
    return 1 if issues else 0


if __name__ == "__main__":
    raise SystemExit(main())
