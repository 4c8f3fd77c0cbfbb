"""Stand-ins for areal-gateway / areal-router / areal-proxy / areal-agent-proxy / an SGLang engine.

Stdlib only. They follow the contract of docs/services.md (flags, ready file,
gateway /health with pid, admin API with the Bearer admin key) so the CLI's
lifecycle can be unit-tested without the real binaries. Not a product: the
real binaries are exercised by tests/cli.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def write_ready(path: str, host: str, port: int) -> None:
    if not path:
        return
    info = {
        "pid": os.getpid(),
        "host": host,
        "port": port,
        "version": "fake",
        "started_at": time.time(),
    }
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", default="")
    p.add_argument("--log-level", default="info")


MODELS: dict[str, dict] = {}
# Admission bounds per model, as PUT /admin/models/{name}/admission set them.
ADMISSION: dict[str, dict] = {}
PAIRS: dict[str, dict] = {}  # agent mode: proxy_id -> worker JSON


class Handler(BaseHTTPRequestHandler):
    role = "gateway"

    def log_message(self, fmt: str, *args: object) -> None:
        sys.stderr.write(f"{self.role} {fmt % args}\n")

    def _send(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _admin(self) -> bool:
        if self.headers.get("Authorization") != f"Bearer {os.environ.get('AREAL_ADMIN_API_KEY')}":
            self._send(401, {"error": {"message": "bad key", "type": "authentication_error"}})
            return False
        return True

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {"status": "ok", "pid": os.getpid()})
        elif self.path == "/admin/models" and self._admin():
            self._send(200, {"models": list(MODELS.values())})
        elif self.path == "/admin/pairs" and self._admin():
            self._send(200, {"pairs": list(PAIRS.values())})
        elif self.path == "/admin/admission" and self._admin():
            models = [
                {
                    "model": name,
                    "max_staleness": None,
                    "batch_size": None,
                    "max_concurrent_rollouts": None,
                    **ADMISSION.get(name, {}),
                    "version": 0,
                    "running": 0,
                    "ended": 0,
                    "consumed": 0,
                    "waiting": 0,
                    "capacity_left": ADMISSION.get(name, {}).get("max_concurrent_rollouts"),
                    "limited_by": "capacity" if ADMISSION.get(name) else None,
                }
                for name in MODELS
            ]
            self._send(200, {"models": models})
        elif self.path == "/admin/workers" and self._admin():
            # Inference replicas say how they read tools, as the router has it from GetStats.
            parsing = {
                "tool_call_parser": os.environ.get("FAKE_TOOL_CALL_PARSER", "hermes"),
                "reasoning_parser": "",
                "default_tool_prompt": True,
            }
            workers = [
                {**w, "model": m["name"], "kind": "inference", **parsing}
                for m in MODELS.values()
                for w in m["workers"]
            ]
            self._send(200, {"workers": list(PAIRS.values()) + workers})
        elif self.path not in ("/admin/models", "/admin/workers", "/admin/pairs"):
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        if self.path == "/admin/pairs" and self._admin():
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if os.environ.get("FAKE_REFUSE_PAIRS"):
                self._send(400, {"error": {"message": "pairs refused as asked"}})
                return
            health = os.environ.get("FAKE_PAIR_HEALTH", "healthy")
            PAIRS[body["proxy_id"]] = {**body, "model": "agent", "kind": "agent", "health": health}
            self._send(201, {**body, "model": "agent"})
        elif self.path.startswith("/admin/workers/") and self.path.endswith("/retire"):
            if self._admin():
                proxy_id = self.path.split("/")[3]
                out = {"proxy_id": proxy_id, "model": "", "finished": 2, "moved": 1, "failed": 0}
                self._send(200, {**out, "message": "retired"})
        elif self.path == "/admin/models" and self._admin():
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if body["name"] in MODELS:
                self._send(409, {"error": {"message": "exists"}})
                return
            workers = [{**p, "health": "healthy"} for p in body.get("proxies", [])]
            MODELS[body["name"]] = {"name": body["name"], "kind": body["kind"], "workers": workers}
            self._send(201, {"name": body["name"], "kind": body["kind"]})

    def do_PUT(self) -> None:
        parts = self.path.split("/")
        if self.path.endswith("/admission") and len(parts) == 5 and self._admin():
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if parts[3] not in MODELS:
                self._send(404, {"error": {"message": "unknown model"}})
                return
            ADMISSION[parts[3]] = body
            self._send(200, {"model": parts[3], **body})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_DELETE(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        if self.path.startswith("/admin/models/") and self._admin():
            if name not in MODELS:
                self._send(404, {"error": {"message": "unknown model"}})
                return
            m = MODELS.pop(name)
            self._send(200, {"name": name, "proxy_ids": [w["proxy_id"] for w in m["workers"]]})


def serve_http(host: str, port: int, ready: str, role: str) -> None:
    Handler.role = role
    srv = ThreadingHTTPServer((host, port), Handler)
    signal.signal(signal.SIGTERM, lambda *a: threading.Thread(target=srv.shutdown).start())
    write_ready(ready, host, srv.server_address[1])
    print(f"{role} listening on {host}:{srv.server_address[1]}", file=sys.stderr, flush=True)
    srv.serve_forever(poll_interval=0.05)


def serve_tcp(host: str, port: int, ready: str, role: str) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    write_ready(ready, host, s.getsockname()[1])
    print(f"{role} listening on {host}:{s.getsockname()[1]}", file=sys.stderr, flush=True)
    while True:
        time.sleep(1)


def main() -> None:
    role, argv = sys.argv[1], sys.argv[2:]
    if os.environ.get("FAKE_CRASH") == role:
        print(f"{role}: crashing as asked (FAKE_CRASH)", file=sys.stderr)
        sys.exit(3)
    if role == "engine":
        # Invoked as: <python> -m sglang.launch_server --model-path ... --port N ...
        p = argparse.ArgumentParser(prog="fake-engine")
        p.add_argument("-m")
        for flag in (
            "--model-path",
            "--served-model-name",
            "--tokenizer-path",
            "--tp-size",
            "--device",
            "--attention-backend",
            "--mem-fraction-static",
            "--max-total-tokens",
        ):
            p.add_argument(flag)
        p.add_argument("--disable-overlap-schedule", action="store_true")
        p.add_argument("--incremental-streaming-output", action="store_true")
        p.add_argument("--sleep-on-idle", action="store_true")
        common(p)
        a = p.parse_args(argv)  # unknown flags: exit 2, like a real engine
        delay = float(os.environ.get("FAKE_ENGINE_DELAY", "0.2"))
        time.sleep(delay)
        serve_http(a.host, a.port, "", "engine")
        return
    p = argparse.ArgumentParser(prog=f"fake-{role}")
    common(p)
    if role == "agent-worker":
        p.add_argument("--agent", required=True)
        p.add_argument("--drain-timeout")
        a = p.parse_args(argv)
        module, _, cls = a.agent.rpartition(".")
        try:
            import importlib

            getattr(importlib.import_module(module), cls)
        except Exception as e:  # like the real worker: one line, exit 2
            print(f"areal-agent-worker: error: cannot load {a.agent}: {e}", file=sys.stderr)
            sys.exit(2)
        serve_tcp(a.host, a.port, a.ready_file, "agent-worker")
        return
    if role == "gateway":
        p.add_argument("--router-addr", required=True)
        p.add_argument("--mode", default="inference")
        p.add_argument("--drain-timeout")
        # The real gateway's flags the CLI passes (areal-gateway >= 0.5).
        p.add_argument("--response-store", default="")
        a = p.parse_args(argv)
        if a.response_store and not os.path.isdir(os.path.dirname(a.response_store)):
            sys.exit("gateway: --response-store's folder does not exist")
        if not os.environ.get("AREAL_ADMIN_API_KEY") or not os.environ.get("AREAL_INTERNAL_TOKEN"):
            sys.exit("gateway: secrets missing from the environment")
        serve_http(a.host, a.port, a.ready_file, "gateway")
    elif role == "router":
        p.add_argument("--policy", default="round_robin")
        p.add_argument("--state-file", default="")
        p.add_argument("--drain-timeout")
        a = p.parse_args(argv)
        serve_tcp(a.host, a.port, a.ready_file, "router")
    elif role == "proxy":
        for flag in (
            "--engine-url",
            "--model",
            "--tokenizer-path",
            "--proxy-id",
            "--engine",
            "--request-timeout",
            "--chat-template-type",
            "--drain-timeout",
            "--db-path",
            "--router-addr",
            "--migration-limit",
        ):
            p.add_argument(flag)
        a = p.parse_args(argv)
        if a.db_path:
            # Like SQLite: plain open() (0666 less the umask) of the db and its WAL.
            for suffix in ("", "-wal"):
                with open(a.db_path + suffix, "a"):
                    pass
        serve_tcp(a.host, a.port, a.ready_file, "proxy")
    elif role == "agent-proxy":
        # Like areal-agent-proxy: no --mode, no engine flags (argparse refuses them).
        for flag in (
            "--proxy-id",
            "--request-timeout",
            "--worker-addr",
            "--session-timeout",
            "--drain-timeout",
            "--inf-gateway-url",
            "--inf-model",
        ):
            p.add_argument(flag)
        a = p.parse_args(argv)
        if not a.worker_addr:
            sys.exit("agent-proxy: --worker-addr is required")
        if a.inf_gateway_url and not os.environ.get("AREAL_PROXY_INF_ADMIN_API_KEY"):
            sys.exit("agent-proxy: linked but AREAL_PROXY_INF_ADMIN_API_KEY is not set")
        serve_tcp(a.host, a.port, a.ready_file, "agent-proxy")


if __name__ == "__main__":
    main()
