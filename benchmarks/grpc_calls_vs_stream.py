"""What a gRPC call costs in Python, against a message on one long-lived stream.

    uv run python benchmarks/grpc_calls_vs_stream.py [--requests 20000]

An echo server in its own process (grpc.aio on uvloop, no proto: bytes in, bytes out) answers
64-byte requests either as one unary call each, or as frames on one bidirectional stream where
each side sends whatever is queued as one message (what areal's `Generate` does). Prints
requests/s, latency and the CPU per request of client and server, at concurrency 1 and 64.
This is why the gateway multiplexes generation requests (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import uvloop

FRAME = 64  # bytes: 56 of payload, then the request number


def _ident(b: bytes) -> bytes:
    return b


async def _batched_writer(queue: list[bytes], wake: asyncio.Event, write: Any) -> None:
    while True:
        await wake.wait()
        wake.clear()
        while queue:
            batch = b"".join(queue)
            queue.clear()
            await write(batch)


async def serve(port_file: str) -> None:
    async def unary(req: bytes, context: Any) -> bytes:
        return req

    async def bidi(frames: Any, context: Any) -> None:
        out: list[bytes] = []
        wake = asyncio.Event()
        writer = asyncio.ensure_future(_batched_writer(out, wake, context.write))
        async for msg in frames:
            for i in range(0, len(msg), FRAME):
                out.append(msg[i : i + FRAME])
            wake.set()
        writer.cancel()

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
            "Stream": grpc.stream_stream_rpc_method_handler(bidi, _ident, _ident),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))  # noqa: ASYNC240 - once, before serving
    await server.wait_for_termination()


async def client(port: int, mode: str, conc: int, n: int) -> tuple[float, float]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    payload = b"x" * (FRAME - 8)
    one: Callable[[int], Awaitable[Any]]
    if mode == "unary":
        call_unary = channel.unary_unary(
            "/bench.Echo/Unary", request_serializer=_ident, response_deserializer=_ident
        )

        async def one(i: int) -> None:
            await call_unary(payload + struct.pack("q", i))

    else:
        call = channel.stream_stream(
            "/bench.Echo/Stream", request_serializer=_ident, response_deserializer=_ident
        )()
        waiters: dict[int, asyncio.Future[None]] = {}
        out: list[bytes] = []
        wake = asyncio.Event()

        async def reader() -> None:
            while (msg := await call.read()) is not grpc.aio.EOF:
                for i in range(0, len(msg), FRAME):
                    (rid,) = struct.unpack("q", msg[i + FRAME - 8 : i + FRAME])
                    waiters.pop(rid).set_result(None)

        tasks = [
            asyncio.ensure_future(reader()),
            asyncio.ensure_future(_batched_writer(out, wake, call.write)),
        ]
        loop = asyncio.get_running_loop()

        async def one(i: int) -> None:
            fut = waiters[i] = loop.create_future()
            out.append(payload + struct.pack("q", i))
            wake.set()
            await fut

    sem = asyncio.Semaphore(conc)

    async def guarded(i: int) -> None:
        async with sem:
            await one(i)

    await asyncio.gather(*(guarded(i) for i in range(500)))  # warm-up
    t = os.times()
    cpu0, t0 = t.user + t.system, time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(1000, 1000 + n)))
    wall = time.perf_counter() - t0
    t = os.times()
    if mode != "unary":
        for task in tasks:
            task.cancel()
    await channel.close()
    return wall, t.user + t.system - cpu0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        uvloop.run(serve(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    args = ap.parse_args()
    port_file = Path(tempfile.mkdtemp(prefix="areal-grpc-bench-")) / "port"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text()):
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the echo server did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())

        def server_cpu() -> float:
            with open(f"/proc/{server.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        print(
            f"{'mode':<8}{'c':>4} {'req/s':>9} {'latency':>10} {'client CPU':>12} {'server CPU':>12}"
        )
        for mode in ("unary", "stream"):
            for conc in (1, 64):
                n = args.requests if conc > 1 else args.requests // 5
                s0 = server_cpu()
                wall, ccpu = uvloop.run(client(port, mode, conc, n))
                scpu = server_cpu() - s0
                print(
                    f"{mode:<8}{conc:>4} {n / wall:>9.0f} {wall / n * conc * 1e6:>8.0f}us "
                    f"{ccpu / n * 1e6:>10.0f}us {scpu / n * 1e6:>10.0f}us"
                )
    finally:
        server.kill()
        server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
