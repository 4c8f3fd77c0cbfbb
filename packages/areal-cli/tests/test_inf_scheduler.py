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
