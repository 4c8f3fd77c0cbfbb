"""Every package declares exactly what its code imports, and internal pins agree.

    uv run python scripts/check_deps.py

1. deptry on each package's `src/` against that package's own pyproject.toml:
   imported but undeclared (DEP001, DEP003) and declared but unused (DEP002)
   both fail. Exceptions a package needs (a dependency used without an import,
   like uvicorn's optional httptools) live in that package's
   `[tool.deptry.per_rule_ignores]`, each with its reason.
2. Every package that depends on another workspace package uses the same
   version range for it, so the packages are never released against two
   different ideas of their siblings.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$")


def _project(pkg: Path) -> dict:
    with (pkg / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]


def run_deptry(pkg: Path) -> bool:
    done = subprocess.run(
        [sys.executable, "-m", "deptry", "src", "--no-ansi"],
        cwd=pkg,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(f"--- {pkg.name}: deptry found problems")
        sys.stdout.write(done.stdout + done.stderr)
        return False
    print(f"--- {pkg.name}: imports match declared dependencies")
    return True


def internal_pins(pkgs: list[Path]) -> bool:
    names = {_project(p)["name"] for p in pkgs}
    seen: dict[str, dict[str, str]] = {}
    for p in pkgs:
        for req in _project(p).get("dependencies", []):
            m = _NAME.match(req.split(";")[0])
            if m and m.group(1) in names:
                seen.setdefault(m.group(1), {})[_project(p)["name"]] = m.group(2).strip()
    ok = True
    for dep, by in sorted(seen.items()):
        specs = set(by.values())
        if len(specs) != 1 or "" in specs:
            ok = False
            print(f"--- internal pin of {dep} differs or is missing: {by}")
    if ok:
        pins = ", ".join(f"{d}{next(iter(b.values()))}" for d, b in sorted(seen.items()))
        print(f"--- internal pins agree: {pins}")
    return ok


def main() -> int:
    pkgs = sorted(p for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists())
    results = [run_deptry(p) for p in pkgs]
    results.append(internal_pins(pkgs))
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
