"""Config: precedence flag > --config > default file > built-in; errors name file and key."""

from __future__ import annotations

import pytest

from areal_cli import config
from areal_cli.errors import CLIError


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_precedence(home, tmp_path):
    _write(
        home / "inf" / "config.toml",
        '[launch]\ngateway_port = 9000\nrouting_strategy = "least_loaded"\n',
    )
    extra = _write(tmp_path / "extra.toml", "[launch]\ngateway_port = 9100\n")
    cfg = config.load("inf", extra)
    assert cfg.pick(9200, "launch", "gateway_port", 8080) == 9200  # flag
    assert cfg.pick(None, "launch", "gateway_port", 8080) == 9100  # --config
    assert (
        cfg.pick(None, "launch", "routing_strategy", "round_robin") == "least_loaded"
    )  # default file
    assert cfg.pick(None, "launch", "gateway_host", "127.0.0.1") == "127.0.0.1"  # built-in
    assert cfg.sources == [home / "inf" / "config.toml", extra]


def test_no_files_is_fine(home):
    cfg = config.load("inf")
    assert cfg.values == {} and cfg.get("launch", "gateway_port") is None


def test_spec_example_is_accepted(home, tmp_path):
    f = _write(
        tmp_path / "inf.toml",
        """
[default]
service = "default"

[launch]
gateway_host = "127.0.0.1"
gateway_port = 8080
routing_strategy = "round_robin"

[scheduler]
type = "local"

[register.internal]
backend = "sglang:d1"
model_health_timeout = 600
engine_args = "--mem-fraction-static 0.8"
proxy_args = "--request-timeout 120 --chat-template-type hf"

[engine.sglang]
python = "/opt/sglang/bin/python"
default_args = "--device cpu"
""",
    )
    cfg = config.load("inf", f)
    assert cfg.get("register.internal", "model_health_timeout") == 600
    assert cfg.get("engine.sglang", "default_args") == "--device cpu"


def test_agent_spec_example_is_accepted(home, tmp_path):
    f = _write(
        tmp_path / "agent.toml",
        '[default]\nservice = "default"\nadmin_api_key = "k"\nlog_level = "info"\n'
        '[run]\nagent = "a.b.C"\nnum_pairs = 2\nsetup_timeout = 120\nhealth_poll_interval = 5\n'
        "drain_timeout = 30\nsession_timeout = 1800\n",
    )
    assert config.load("agent", f).get("run", "num_pairs") == 2


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[launch]\ngateway_prot = 1\n", "unknown key 'gateway_prot' in [launch]"),
        ("[lunch]\nx = 1\n", "unknown table [lunch]"),
        ("[register.internal]\nbackend = 3\n", "[register.internal] key 'backend' must be str"),
        ("[launch]\ngateway_port = true\n", "key 'gateway_port' must be int"),
        ("[register]\nbackend = 'x'\n", "unknown key 'backend' in [register]"),
        ("service = 'x'\n", "key 'service' is not inside a known table"),
        ("[launch\n", "malformed TOML"),
        ("[engine.tgi]\npython = 'x'\n", "unknown table [engine.tgi]"),
    ],
)
def test_errors_name_file_and_key(home, tmp_path, text, needle):
    f = _write(tmp_path / "bad.toml", text)
    with pytest.raises(CLIError) as info:
        config.load("inf", f)
    assert str(f) in info.value.message
    assert needle in info.value.message
    assert "\n" not in info.value.message


def test_bad_default_file_is_an_error_too(home):
    _write(home / "inf" / "config.toml", "[launch]\nnope = 1\n")
    with pytest.raises(CLIError, match=r"config\.toml: unknown key 'nope'"):
        config.load("inf")


def test_missing_explicit_file_is_usage_error(home, tmp_path):
    with pytest.raises(CLIError) as info:
        config.load("inf", tmp_path / "missing.toml")
    assert info.value.code == 2


def test_float_accepts_int(home, tmp_path):
    f = _write(tmp_path / "a.toml", "[launch]\nlaunch_timeout = 5\n[stop]\ngrace_period = 0.5\n")
    cfg = config.load("inf", f)
    assert cfg.get("launch", "launch_timeout") == 5
    assert cfg.get("stop", "grace_period") == 0.5
