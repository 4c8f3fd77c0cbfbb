"""`areal-proxy --mode agent` points at the agent proxy's own binary instead of serving."""

from __future__ import annotations

import logging

import pytest

from areal_proxy.__main__ import main
from areal_proxy.settings import load_settings


def test_mode_agent_names_the_binary_that_serves_it(caplog: pytest.LogCaptureFixture) -> None:
    assert load_settings(["--mode", "agent"]).problems() == [
        "--mode agent: the agent worker's data proxy is its own binary now; run "
        "areal-agent-proxy --worker-addr HOST:PORT (package areal-agent-proxy)"
    ]
    with caplog.at_level(logging.ERROR):
        assert main(["--mode", "agent"]) == 2
    assert "areal-agent-proxy" in caplog.text


def test_agent_flags_are_not_proxy_flags() -> None:
    with pytest.raises(SystemExit) as e:
        load_settings(["--worker-addr", "127.0.0.1:1"])
    assert e.value.code == 2
