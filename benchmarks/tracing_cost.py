"""What OpenTelemetry tracing costs on the data path: tracing off vs on, side by side.

    uv run python benchmarks/tracing_cost.py [--rounds 2] [--requests-c1 300] [--requests-c32 1500]

Starts the zero-cost fake engine (fake_engine.py) and two areal stacks in front of it (router,
gateway, one proxy each; tests/e2e/stack.py, the code the CLI uses): one started with no OTEL_*
variable (tracing off: opentelemetry is never imported), one with OTEL_TRACES_EXPORTER=otlp
exporting over OTLP/HTTP to a receiver this script runs on loopback (it decodes nothing; it
counts requests and bytes). Every request carries a client `traceparent` (the untraced gateway
ignores it), so with tracing on every request is sampled and exported: the worst case.

For each configuration (chat with the admin key at concurrency 1 and 32, whole and streamed;
a recorded session's chat at concurrency 1), rounds alternate off and on; each cell is the
median over rounds. Printed: requests/s and the CPU ms per request of gateway + router + proxy
(from /proc/<pid>/stat, the process trees), off, on, and on/off as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from vs_smg import (
    ADMIN_KEY,
    chat_body,
    process_tree,
    run_load,
    start_fake_engine,
    start_quiet_stack,
    start_session,
)

from areal_cli import supervisor

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class CountingReceiver:
    """An OTLP/HTTP endpoint that accepts every export and counts it."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver.requests += 1
                receiver.bytes += len(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_stack_with(tmp: Path, engine_url: str, env: dict[str, str]):
    """A quiet stack whose processes inherit `env` on top of this process's environment."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return start_quiet_stack(tmp, engine_url)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def areal_pids(stack) -> dict[str, list[int]]:
    return {
        "areal": [
            *process_tree(stack.gateway.popen.pid),
            *process_tree(stack.router.popen.pid),
            *process_tree(stack.proxies[0].popen.pid),
        ]
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests-c1", type=int, default=300)
    ap.add_argument("--requests-c32", type=int, default=1500)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    for k in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[k]
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} ({os.cpu_count()} cpus)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="areal-tracing-cost-"))
    receiver = CountingReceiver()
    engine, engine_url = start_fake_engine(tmp, args.tokens)
    stacks = {}
    try:
        stacks["off"] = start_stack_with(tmp / "off", engine_url, {})
        stacks["on"] = start_stack_with(
            tmp / "on",
            engine_url,
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
        )
        configs = [
            ("admin c=1", "admin", 1, False),
            ("admin c=32", "admin", 32, False),
            ("admin c=32 stream", "admin", 32, True),
            ("session c=1", "session", 1, False),
        ]
        runs: dict[tuple[str, str], list[dict]] = {}
        for rnd in range(args.rounds):
            for label, who, conc, stream in configs:
                n = args.requests_c1 if conc == 1 else args.requests_c32
                for mode in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
                    stack = stacks[mode]
                    key = ADMIN_KEY
                    if who == "session":
                        key = start_session(stack.gateway_url, f"tracing-{rnd}-{mode}")
                    headers = {
                        "Content-Type": "application/json",
                        "Authorization": f"Bearer {key}",
                        "traceparent": TRACEPARENT,
                    }
                    r = asyncio.run(
                        run_load(
                            stack.gateway_url + "/v1/chat/completions",
                            chat_body(stream, args.tokens),
                            headers,
                            n,
                            conc,
                            stream,
                            areal_pids(stack),
                        )
                    )
                    if r["errors"]:
                        print(f"  {label} {mode}: {r['error_kinds']}", file=sys.stderr)
                    runs.setdefault((label, mode), []).append(r)
                    print(
                        f"  round {rnd + 1} {label:<18} {mode:<3} {r['rps']:8.0f} req/s "
                        f"{r['cpu_ms']['areal']:6.3f} CPU ms/req",
                        file=sys.stderr,
                    )
        print(
            "\n| config | req/s off | req/s on | on/off | CPU ms/req off | CPU ms/req on | "
            "on/off |\n| --- | --- | --- | --- | --- | --- | --- |"
        )
        for label, *_ in configs:
            off, on = runs[(label, "off")], runs[(label, "on")]
            rps = [statistics.median(r["rps"] for r in x) for x in (off, on)]
            cpu = [statistics.median(r["cpu_ms"]["areal"] for r in x) for x in (off, on)]
            print(
                f"| {label} | {rps[0]:,.0f} | {rps[1]:,.0f} | {rps[1] / rps[0]:.2f} | "
                f"{cpu[0]:.3f} | {cpu[1]:.3f} | {cpu[1] / cpu[0]:.2f} |"
            )
        print(
            f"\nreceiver: {receiver.requests} OTLP exports, {receiver.bytes / 1e6:.1f} MB",
            file=sys.stderr,
        )
    finally:
        for stack in stacks.values():
            stack.stop()
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
        receiver.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
