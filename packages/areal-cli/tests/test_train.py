"""`areal train run`: the exit-code table of docs/cli.md, with drivers in tmp modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.fixture
def proj(tmp_path):
    (tmp_path / "drivers").mkdir()
    (tmp_path / "drivers" / "__init__.py").write_text("")
    (tmp_path / "drivers" / "d.py").write_text(
        textwrap.dedent(
            """
            import json, os
            def main(args):
                with open(os.environ["OUT"], "w") as f:
                    json.dump(args, f)
                return int(os.environ.get("RET", "0")) if os.environ.get("RET") != "none" else None
            def boom(args):
                raise RuntimeError("driver exploded")
            def text(args):
                return "not an int"
            NOT_CALLABLE = 3
            """
        )
    )
    (tmp_path / "drivers" / "broken.py").write_text("import does_not_exist_anywhere\n")
    (tmp_path / "exp.yaml").write_text("a: 1\n")
    return tmp_path


def areal(proj, *args, env=None):
    import os

    e = {**os.environ, "OUT": str(proj / "out.json"), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "areal_cli.main", "train", "run", *args],
        cwd=proj,
        capture_output=True,
        text=True,
        env=e,
        timeout=60,
    )


def test_argv_is_config_abs_then_overrides_verbatim(proj):
    import json

    p = areal(
        proj, "--config", "exp.yaml", "--driver", "drivers.d:main", "a=1", "--foo", "b.c=2", "--x=y"
    )
    assert p.returncode == 0, p.stderr
    assert json.loads((proj / "out.json").read_text()) == [
        "--config",
        str(proj / "exp.yaml"),
        "a=1",
        "--foo",
        "b.c=2",
        "--x=y",
    ]


@pytest.mark.parametrize(("ret", "code"), [("7", 7), ("0", 0), ("none", 0)])
def test_int_return_is_exit_code(proj, ret, code):
    p = areal(proj, "--config", "exp.yaml", "--driver", "drivers.d:main", env={"RET": ret})
    assert p.returncode == code, p.stderr


def test_non_int_return_is_zero(proj):
    assert areal(proj, "--config", "exp.yaml", "--driver", "drivers.d:text").returncode == 0


def test_driver_without_colon_is_usage_error(proj):
    p = areal(proj, "--config", "exp.yaml", "--driver", "drivers.d.main")
    assert p.returncode == 2
    assert "module.path:func" in p.stderr


@pytest.mark.parametrize("mod", ["drivers.nope:main", "drivers.broken:main"])
def test_unimportable_module_is_1(proj, mod):
    p = areal(proj, "--config", "exp.yaml", "--driver", mod)
    assert p.returncode == 1
    assert p.stderr.startswith("error: cannot import driver module")
    assert "Traceback" not in p.stderr


def test_missing_function_is_1(proj):
    p = areal(proj, "--config", "exp.yaml", "--driver", "drivers.d:nothing")
    assert p.returncode == 1
    assert "has no function 'nothing'" in p.stderr


def test_missing_config_is_2(proj):
    p = areal(proj, "--config", "missing.yaml", "--driver", "drivers.d:main")
    assert p.returncode == 2
    assert "does not exist" in p.stderr


def test_driver_exceptions_are_not_swallowed(proj):
    p = areal(proj, "--config", "exp.yaml", "--driver", "drivers.d:boom")
    assert p.returncode == 1
    assert "Traceback" in p.stderr and "RuntimeError: driver exploded" in p.stderr
