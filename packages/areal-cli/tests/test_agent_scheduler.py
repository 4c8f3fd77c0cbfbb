"""`areal agent run --scheduler`: what is checked before anything starts, what is pinned.

The Ray path itself runs on a real cluster in tests/cluster/test_ray_agent.py; here Ray is
never imported (this package's test environment may not have it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli import config
from areal_cli import state as st
from areal_cli.agent import launch
from areal_cli.agent.commands import app
from areal_cli.errors import CLIError


@pytest.fixture
def no_ray(monkeypatch):
    """`import ray` fails, as where Ray is not installed."""
    monkeypatch.setitem(sys.modules, "ray", None)


def _resolve(**opts):
    return launch.resolve(config.load("agent"), launch.RunOptions(agent="a.B", **opts))


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"scheduler": "slurm"}, "invalid --scheduler 'slurm' (choose from local, ray)"),
        ({"ray_address": "10.0.0.1:6379"}, "--ray-address needs --scheduler ray"),
        (
            {"scheduler": "local", "ray_address": "auto"},
            "--ray-address needs --scheduler ray",
        ),
    ],
)
def test_scheduler_usage_errors(home, opts, needle):
    with pytest.raises(CLIError) as e:
        _resolve(**opts)
    assert e.value.message == needle and e.value.code == 2


def test_scheduler_type_from_config_is_checked_too(home):
    (home / "agent").mkdir()
    (home / "agent" / "config.toml").write_text('[scheduler]\ntype = "k8s"\n')
    with pytest.raises(CLIError, match=r"invalid --scheduler 'k8s' \(choose from local, ray\)"):
        _resolve()


def test_flag_over_config_scheduler(home):
    (home / "agent").mkdir()
    (home / "agent" / "config.toml").write_text('[scheduler]\ntype = "ray"\n')
    assert _resolve().scheduler == "ray"
    assert _resolve(scheduler="local").scheduler == "local"


def test_local_is_the_default_and_pins_no_cluster(home):
    plan = _resolve()
    assert (plan.scheduler, plan.ray_address, plan.ray) == ("local", None, None)
    s = launch._initial_state(plan)
    assert s["scheduler"] == "local" and "ray" not in s


def test_ray_plan_resolves_without_ray(home, no_ray):
    plan = _resolve(scheduler="ray", ray_address="10.0.0.1:6379")
    assert (plan.scheduler, plan.ray_address, plan.ray) == ("ray", "10.0.0.1:6379", None)


def test_ray_settings_are_pinned_into_the_state(home):
    plan = _resolve(scheduler="ray")
    plan.ray = {
        "ray_address": "auto",
        "device_resource": "CPU",
        "shared_dir": "",
        "driver_node": "10.0.0.1",
    }
    s = launch._initial_state(plan)
    assert s["scheduler"] == "ray" and s["ray"] == plan.ray


def test_ray_without_ray_installed_fails_before_anything_starts(home, no_ray, monkeypatch):
    monkeypatch.setattr(launch, "resolve_binary", lambda cfg, key: "/bin/true")
    with pytest.raises(CLIError) as e:
        launch.run(config.load("agent"), launch.RunOptions(agent="a.B", scheduler="ray"))
    assert e.value.code == 2
    assert "--scheduler ray needs Ray, which is not installed" in e.value.message
    assert "areal-cli[ray]" in e.value.message
    assert st.load("agent", "default") is None


def test_cli_flags_reach_the_plan(home, monkeypatch):
    from typer.testing import CliRunner

    seen = {}

    def fake_run(cfg, o):
        seen["o"] = o
        return 0

    monkeypatch.setattr(launch, "run", fake_run)
    r = CliRunner().invoke(
        app, ["run", "--agent", "a.B", "--scheduler", "ray", "--ray-address", "h:1"]
    )
    assert r.exit_code == 0, r.output
    assert (seen["o"].scheduler, seen["o"].ray_address) == ("ray", "h:1")
    r = CliRunner().invoke(app, ["run", "--agent", "a.B"])
    assert r.exit_code == 0, r.output
    assert (seen["o"].scheduler, seen["o"].ray_address) == (None, None)


def test_cli_ray_address_without_ray_is_a_usage_error(home):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_cli.main",
            "agent",
            "run",
            "--agent",
            "a.B",
            "--ray-address",
            "x",
        ],
        capture_output=True,
        text=True,
        cwd=Path(home),
        timeout=60,
    )
    assert p.returncode == 2
    assert p.stderr.strip() == "error: --ray-address needs --scheduler ray"
