"""What the gateway's per-client connection limit costs a big client pool.

One aiohttp session of `--pool` (500) connections sends `--waves` (10) waves of that many
POSTs at uvicorn with the gateway's guarded protocol (http_protocol.py) and a trivial app
(5 ms per request), first with the per-client limit below the pool (256: the responses past
it say `Connection: close` and the pool reconnects), then above it (1,024: every connection
kept), side by side, `--rounds` times. Per run: seconds, connections the pool opened, and
failed requests (must be 0 in both).

    uv run python benchmarks/client_pool.py [--pool 500] [--waves 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from typing import Any

import aiohttp
import uvicorn

from areal_gateway.http_protocol import guarded_protocol
from areal_gateway.server import loop_factory


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(0.005)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


class Server:
    """uvicorn with the guarded protocol in a thread of its own (its own loop, as the
    gateway's process would be)."""

    def __init__(self, limit: int) -> None:
        config = uvicorn.Config(
            app,
            http=guarded_protocol(60.0, limit),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
        )
        self.server = uvicorn.Server(config)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(2048)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        new_loop = loop_factory() or asyncio.new_event_loop
        self.thread = threading.Thread(
            target=lambda: asyncio.runners.Runner(loop_factory=new_loop).run(
                self.server.serve(sockets=[self.sock])
            ),
            daemon=True,
        )

    def __enter__(self) -> Server:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


async def waves(port: int, pool: int, n: int) -> tuple[float, int, int]:
    opened = failed = 0

    async def counted(*_: Any) -> None:
        nonlocal opened
        opened += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(counted)
    conn = aiohttp.TCPConnector(limit=pool)
    async with aiohttp.ClientSession(
        f"http://127.0.0.1:{port}", connector=conn, trace_configs=[trace]
    ) as http:

        async def one() -> None:
            nonlocal failed
            try:
                async with http.post("/x", json={"a": 1}) as r:
                    await r.read()
                    failed += r.status != 200
            except aiohttp.ClientError:
                failed += 1

        t = time.perf_counter()
        for _ in range(n):
            await asyncio.gather(*(one() for _ in range(pool)))
        return time.perf_counter() - t, opened, failed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pool", type=int, default=500)
    p.add_argument("--waves", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    print("| limit | requests | seconds | connections opened | failed |")
    print("|---|---|---|---|---|")
    for _ in range(a.rounds):
        for limit in (256, 1024):
            with Server(limit) as s:
                dt, opened, failed = asyncio.run(waves(s.port, a.pool, a.waves))
            print(f"| {limit} | {a.pool * a.waves} | {dt:.2f} | {opened} | {failed} |", flush=True)


if __name__ == "__main__":
    main()
