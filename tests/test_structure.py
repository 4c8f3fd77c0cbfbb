"""The structure rules CI enforces, checked on the repository and on small made-up trees.

- scripts/check_sizes.py: a module over 500 lines or a class over 300 fails unless
  scripts/size_allowlist.toml names it with a reason; a stale entry fails too.
- importlinter.toml: every workspace package has a layers contract over its own modules, and
  the contracts hold (`lint-imports`).
- scripts/gen_sync_client.py: areal-client's sync client is exactly what unasync makes of the
  async one.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check_sizes = _load_script("check_sizes")


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _lines(n: int) -> str:
    return "".join(f"x{i} = {i}\n" for i in range(n))


def _class(name: str, n: int) -> str:
    """A class of exactly n lines."""
    return f"class {name}:\n" + "".join(f"    a{i} = {i}\n" for i in range(n - 1))


def test_limits_are_500_and_300_lines_exactly(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "packages/p/src/p/ok.py": _lines(500),
            "packages/p/src/p/big.py": _lines(501),
            "packages/p/src/p/classes.py": _class("Fine", 300) + _class("Huge", 301),
            "packages/p/src/p/gen_pb2.py": _lines(2000),  # generated: not counted
        },
    )
    found = {o.name: o.lines for o in check_sizes.measure(root)}
    assert found == {
        "packages/p/src/p/big.py": 501,
        "packages/p/src/p/classes.py:Huge": 301,
        # the module of both classes is 601 lines
        "packages/p/src/p/classes.py": 601,
    }


def test_an_unlisted_offender_and_a_stale_entry_both_fail(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"packages/p/src/p/big.py": _lines(501)})
    found = check_sizes.measure(root)
    [unlisted] = check_sizes.problems(found, {})
    assert "packages/p/src/p/big.py: 501 lines, over the module limit of 500" in unlisted
    assert "scripts/size_allowlist.toml" in unlisted
    assert check_sizes.problems(found, {"packages/p/src/p/big.py": "why"}) == []
    [stale] = check_sizes.problems([], {"packages/p/src/p/big.py": "why"})
    assert "no longer over its limit" in stale


def test_an_allowlist_entry_without_a_reason_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "allow.toml"
    path.write_text('[modules]\n"packages/p/src/p/big.py" = ""\n')
    with pytest.raises(SystemExit, match="needs a reason"):
        check_sizes.load_allowlist(path)


def test_the_repository_keeps_the_size_rule() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_sizes.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_package_has_a_layers_contract() -> None:
    with (ROOT / "importlinter.toml").open("rb") as f:
        config = tomllib.load(f)["tool"]["importlinter"]
    layered = {
        c["containers"][0]
        for c in config["contracts"]
        if c["type"] == "layers" and c.get("exhaustive")
    }
    packages = set()
    for pyproject in (ROOT / "packages").glob("*/pyproject.toml"):
        imports = [p.name for p in (pyproject.parent / "src").iterdir() if p.is_dir()]
        packages.update(i for i in imports if not i.endswith(".egg-info"))
    # areal_proto is generated code only: its layout is scripts/gen_proto.py's. A subpackage
    # may have a contract of its own (areal_proxy's stages) inside its package's.
    assert packages - {"areal_proto"} == {c for c in layered if "." not in c}
    assert {c.split(".")[0] for c in layered} <= packages
    assert set(config["root_packages"]) == packages


def test_the_layer_contracts_hold() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "lint-imports is in the workspace's dev group (uv sync)"
    done = subprocess.run(
        [lint, str(ROOT / "importlinter.toml"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_sync_client_is_generated_from_the_async_one() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_sync_client.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_edited_sync_client_is_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _load_script("gen_sync_client")
    edited = tmp_path / "client.py"
    edited.write_text(gen.TARGET.read_text().replace("def health", "def health_by_hand"))
    monkeypatch.setattr(gen, "TARGET", edited)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
