"""`areal inf run --scheduler`: what is refused before anything starts. Ray is never
imported here (this package's test environment does not have it); the Ray path itself runs
on a real cluster in tests/cluster/test_ray_inf.py."""

from __future__ import annotations

import sys

import pytest

from areal_cli import config
from areal_cli import state as st
from areal_cli.errors import CLIError
from areal_cli.inf import launch


@pytest.fixture
def no_ray(monkeypatch):
    """`import ray` fails, as where Ray is not installed."""
    monkeypatch.setitem(sys.modules, "ray", None)


def _run(**opts):
    o = launch.RunOptions(
        service="s",
        host=None,
        port=None,
        admin_api_key=None,
        scheduler=opts.pop("scheduler", None),
        detach=True,
        force=False,
        routing_strategy=None,
        log_level=None,
        launch_timeout=None,
        model=launch.ModelOptions(),
        **opts,
    )
    return launch.run(config.load("inf"), o)


@pytest.mark.parametrize(
    ("opts", "needle", "code"),
    [
        ({"scheduler": "slurm"}, "invalid --scheduler 'slurm' (choose from local, ray)", 2),
        ({"ray_address": "10.0.0.1:6379"}, "--ray-address needs --scheduler ray", 2),
        (
            {"scheduler": "ray", "ray_address": "ray://head:10001"},
            "a Ray Client address ('ray://head:10001') is not supported",
            2,
        ),
        ({"scheduler": "ray"}, "--scheduler ray needs Ray, which is not installed", 2),
    ],
)
def test_refused_before_anything_starts(home, no_ray, opts, needle, code):
    with pytest.raises(CLIError) as e:
        _run(**opts)
    assert needle in e.value.message and e.value.code == code
    assert st.load("inf", "s") is None  # no state, so nothing was started


def test_the_missing_extra_names_the_install_command(home, no_ray):
    with pytest.raises(CLIError) as e:
        _run(scheduler="ray")
    assert "pip install 'areal-cli[ray]'" in e.value.message


def test_scheduler_type_from_config_is_checked(home):
    (home / "inf").mkdir()
    (home / "inf" / "config.toml").write_text('[scheduler]\ntype = "k8s"\n')
    with pytest.raises(CLIError, match=r"invalid --scheduler 'k8s' \(choose from local, ray\)"):
        _run()


def test_a_ray_units_proxy_is_given_the_routers_address(home, monkeypatch):
    """Migration: a data proxy on any node asks the router for its peers, at the address
    the router listens on with Ray (the CLI node's, recorded in the state)."""
    from types import SimpleNamespace

    from areal_cli import backend as bk
    from areal_cli.inf import ray_units
    from areal_cli.launcher import Launcher

    state = {"router": {"address": "10.0.0.1:4567"}, "ray": {"shared_dir": ""}}
    launcher = Launcher("inf", "s", state, {"AREAL_INTERNAL_TOKEN": "t"})
    spec = SimpleNamespace(
        name="m",
        backend=bk.parse("sglang:d2"),
        python=sys.executable,
        model_path="/models/m",
        tokenizer_path="/models/m",
        engine_args="",
        proxy_args="--migration-limit 1",
        health_timeout=60.0,
    )
    opts = {"log_level": "info", "launch_timeout": 30.0}
    unit = ray_units._unit(
        launcher, spec, "areal-proxy", opts, [], "m-worker-1", "m-data-proxy-1", {}
    )
    argv = next(p["argv"] for p in unit["processes"] if p["name"] == "m-data-proxy-1")
    assert argv[argv.index("--router-addr") + 1] == "10.0.0.1:4567"
    assert argv[-2:] == ["--migration-limit", "1"]  # --proxy-args after it: they may override
