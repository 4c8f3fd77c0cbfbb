"""The watchdog never restarts an engine that is only busy: an engine whose `/health` stops
answering is left alone while its data proxy vouches for it (`areal_proxy_engine_healthy 1`
on the proxy's metrics: the proxy sees its tokens flow), and restarted as hung once the proxy
says it is not (stalled) - a flood on one CPU replica had its engine killed after 38 s and
every request on it failed. Real probes over loopback HTTP; stand-in processes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_watchdog import FAST, comp, svc, tick_until

from areal_cli import supervisor
from areal_cli.watchdog import Watchdog, sup_info

__all__ = ["svc"]  # the fixture, used by name


class _Answers:
    engine_ok = True  # the engine's /health
    vouch = 1  # the proxy's areal_proxy_engine_healthy


def _serve(answers: _Answers) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self.send_response(200 if answers.engine_ok else 503)
                self.end_headers()
                return
            body = f"# TYPE areal_proxy_engine_healthy gauge\nareal_proxy_engine_healthy {answers.vouch}.0\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def answers() -> Iterator[_Answers]:
    yield _Answers()


def test_a_busy_engine_vouched_for_by_its_proxy_is_not_restarted(svc, tmp_path, answers):
    server = _serve(answers)
    try:
        port = server.server_address[1]
        url = f"http://127.0.0.1:{port}"
        _, engine = svc("m-worker-0", "engine", ["sleep", "60"], url=url)
        ready = tmp_path / "proxy.ready"
        proc, _ = svc(
            "m-data-proxy-0", "proxy", ["sh", "-c", "sleep 60", "--ready-file", str(ready)]
        )
        info = {"pid": proc.pid, "host": "127.0.0.1", "port": 1, "metrics_port": port}
        ready.write_text(json.dumps({**info, "engine_url": url}))
        wd = Watchdog("inf", "svc", policy=FAST, log=lambda m: None)
        wd.tick()  # the engine answered once: from now on it may be called hung
        assert wd.tracks["m-worker-0"].answered
        answers.engine_ok = False  # busy: its health check no longer answers
        for _ in range(3 * FAST.hung_after * 4):  # well past the engine's hung threshold
            wd.tick()
        assert comp("m-worker-0").pid == engine.pid, "a busy engine was restarted"
        assert sup_info(comp("m-worker-0")).get("state") in (None, "running")
        # The proxy says it stalled: hung, restarted.
        answers.vouch = 0
        tick_until(wd, lambda: comp("m-worker-0").pid != engine.pid)
        assert sup_info(comp("m-worker-0"))["last_failure"]["reason"].startswith("hung")
        assert not supervisor.group_alive(engine)
    finally:
        server.shutdown()
