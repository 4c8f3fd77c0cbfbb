"""No client-visible error names an internal address (host:port, a URL of an engine or a
proxy): the client is told what happened and what to do, the operator's log keeps the
detail. Real sockets: the gateway, fake proxies, and a replica registered at an address
where nothing listens."""

from __future__ import annotations

import logging
import re
import socket

import pytest
from conftest import ADMIN_KEY, Stack

from areal_gateway.clients.redact import redact
from areal_proto.router.v1 import router_pb2

HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+|localhost:\d+|://|ipv4:")


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens


@pytest.mark.parametrize(
    "text",
    [
        "engine unreachable at http://10.0.0.7:30000: Cannot connect",
        "proxy 10.0.0.7:50051 failed: unavailable",
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: refused",
        "peer proxy p-1 (node-3.cluster:50051) did not answer",
        "engine at [::1]:8000 failed its health check",
    ],
)
def test_addresses_are_redacted(text: str) -> None:
    out = redact(text)
    assert not ADDRESS.search(out) and "node-3" not in out and "::1" not in out
    assert "(an internal address)" in out


def test_words_that_are_not_addresses_stay() -> None:
    text = "'messages[0].content' must be a string; max_tokens 16 of 2048 at 12.5 tok/s"
    assert redact(text) == text


@pytest.fixture(scope="module")
def models(stack: Stack) -> tuple[str, str]:
    stack.register("m-addr")
    # A model whose only replica's proxy is registered where nothing listens.
    stack.router.models["m-dead"] = router_pb2.ModelInfo(
        name="m-dead", kind=router_pb2.MODEL_KIND_INTERNAL, created_unix_s=1700000000
    )
    stack.router.proxies["m-dead-p"] = router_pb2.ProxyInfo(
        proxy_id="m-dead-p",
        address=_dead_address(),
        model="m-dead",
        kind=router_pb2.PROXY_KIND_INFERENCE,
        health=router_pb2.PROXY_HEALTH_HEALTHY,
    )
    return "m-addr", "m-dead"


@pytest.mark.parametrize("stream", [False, True])
def test_a_proxys_error_naming_its_engine_reaches_the_client_without_it(
    models, http, stream: bool, caplog
) -> None:
    fake = {
        "error_status": 503,
        "error_message": "engine unreachable at http://10.9.8.7:30000: Connection refused",
    }
    body = {
        "model": models[0],
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "fake": fake,
    }
    with caplog.at_level(logging.WARNING, logger="areal_gateway.errors"):
        r = http.post("/v1/chat/completions", json=body, headers=HEADERS)
    assert r.status_code == 503
    assert not ADDRESS.search(r.text), r.text
    assert "engine unreachable" in r.text  # what happened is still said
    assert "10.9.8.7:30000" in caplog.text  # the operator's log keeps it


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_unreachable_replica_is_reported_without_its_address(models, http, path) -> None:
    body = (
        {"model": models[1], "messages": [{"role": "user", "content": "hi"}]}
        if "chat" in path
        else {"model": models[1], "prompt": "hi"}
    )
    r = http.post(path, json=body, headers=HEADERS, timeout=30)
    assert r.status_code >= 500
    assert not ADDRESS.search(r.text), r.text
    assert "retry" in r.json()["error"]["message"].lower()
