"""The CLI's reading of the gateway's /health: "degraded" is the service behind a
working gateway, so the watchdog must not restart it, and `areal inf status` shows it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from areal_cli import lifecycle
from areal_cli.http import gateway_health, gateway_healthy

DEGRADED = {
    "status": "degraded",
    "pid": 4242,
    "router": "ok",
    "models": {"tiny": {"healthy": 0, "total": 1}},
}


class _Gateway(BaseHTTPRequestHandler):
    body: dict = DEGRADED
    code = 200

    def do_GET(self):
        raw = json.dumps(self.body).encode()
        self.send_response(self.code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *a):
        pass


@pytest.fixture
def gateway() -> Iterator[tuple[str, type[_Gateway]]]:
    handler = type("H", (_Gateway,), {})
    srv = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()


def test_degraded_is_a_live_gateway_draining_is_not(gateway) -> None:
    url, handler = gateway
    assert gateway_healthy(url, 4242), "the watchdog would restart a working gateway"
    assert gateway_health(url, 4242) == DEGRADED
    assert not gateway_healthy(url, 1), "another process's gateway"
    handler.body, handler.code = {"status": "draining", "pid": 4242}, 503
    assert not gateway_healthy(url, 4242)


def test_status_prints_what_health_says_of_the_service(capsys) -> None:
    doc = {
        "service": "default",
        "group": "inf",
        "scheduler": "local",
        "status": "running",
        "supervision": {"enabled": False},
        "gateway": {"url": "http://127.0.0.1:1", "alive": True, "healthy": True},
        "serving": DEGRADED,
        "models": [{"name": "tiny"}],
        "components": {},
    }
    lifecycle.print_status(doc)
    out = capsys.readouterr().out
    assert "serving   degraded (tiny 0/1 replicas healthy)" in out
