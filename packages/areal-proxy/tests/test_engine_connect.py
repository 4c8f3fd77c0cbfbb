"""A request whose connection to the engine was never made: both engine clients.

Nothing of it reached the engine, so a generation is a retryable 503 (the proxy may send it
elsewhere), and a control call (pause, resume, weights) is tried again before it fails. A
listener with a full accept queue leaves a connect unanswered, as a CPU engine busy on every
core once did in CI (a trainer's pause failed with 502 after 5 s).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from areal_proxy.engine import EngineError, GenerationRequest
from areal_proxy.engine.sglang import SGLangClient
from areal_proxy.engine.transport import CONTROL_ATTEMPTS
from areal_proxy.engine.vllm import VLLMClient

CLIENTS = {"sglang": SGLangClient, "vllm": VLLMClient}


@pytest.fixture
def unanswered() -> Iterator[str]:
    """The URL of a listener whose accept queue is full: a connect there is never answered."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        filler.close()
        listener.close()


def _refused() -> str:
    """The URL of a port nothing listens on: a connect there is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _client(kind: str, url: str) -> Any:
    return CLIENTS[kind](url, timeout=10, connect_timeout=0.2)


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("connect", ["refused", "unanswered"])
async def test_a_connection_never_made_is_a_retryable_503(
    kind: str, stream: bool, connect: str, unanswered: str
):
    client = _client(kind, unanswered if connect == "unanswered" else _refused())
    try:
        assert not await client.health()
        with pytest.raises(EngineError) as info:
            if stream:
                async for _ in client.generate_stream(GenerationRequest([1], 3)):
                    pass
            else:
                await client.generate(GenerationRequest([1], 3))
        assert info.value.status == 503 and info.value.retryable, info.value
    finally:
        await client.close()


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_control_call_tries_again_before_it_fails(kind: str, unanswered: str):
    client = _client(kind, unanswered)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError) as info:
            await client.pause("abort")
        elapsed = time.monotonic() - t0
    finally:
        await client.close()
    assert info.value.status == 503 and info.value.retryable
    # Every attempt waited out its connect timeout.
    assert elapsed >= CONTROL_ATTEMPTS * 0.2


async def _control_app(seen: list[str]) -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    return app


@pytest.mark.parametrize("kind", CLIENTS)
async def test_a_pause_reaches_an_engine_that_accepts_on_a_later_try(kind: str):
    url = _refused()
    port = int(url.rsplit(":", 1)[1])
    client = _client(kind, url)
    seen: list[str] = []
    runner = web.AppRunner(await _control_app(seen))
    await runner.setup()
    try:
        pause = asyncio.ensure_future(client.pause("abort"))
        await asyncio.sleep(0.05)  # the first try was refused: nothing listened yet
        assert not pause.done()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.wait_for(pause, 5)
        assert seen == ["/pause_generation" if kind == "sglang" else "/pause"]
    finally:
        await client.close()
        await runner.cleanup()


async def _generate_app(seen: list[str]) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.path)
        body = await request.json()
        meta = {
            "completion_tokens": 1,
            "prompt_tokens": len(body["input_ids"]),
            "output_token_logprobs": [[-0.1, 7, None]],
            "finish_reason": {"type": "length"},
        }
        event = {"output_ids": [7], "meta_info": meta}
        if not body.get("stream"):
            return web.json_response(event)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", handler)
    return app


@pytest.mark.parametrize("stream", [False, True])
async def test_a_generation_whose_connect_times_out_waits_for_the_same_engine(stream: bool):
    """A busy engine's full accept queue: the connection is not answered in time. The request
    is tried again on that engine (it is busy, not gone) rather than failed as lost, which sent
    it to migrate to peers a single replica does not have."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout=10, connect_timeout=0.2)
    seen: list[str] = []
    runner = web.AppRunner(await _generate_app(seen))
    await runner.setup()
    try:

        async def call() -> list[int]:
            if stream:
                return [
                    t
                    for c in [c async for c in client.generate_stream(GenerationRequest([1], 1))]
                    for t in c.token_ids
                ]
            return (await client.generate(GenerationRequest([1], 1))).token_ids

        task = asyncio.ensure_future(call())
        await asyncio.sleep(0.3)  # the first try was not answered
        assert not task.done()
        filler.close()
        listener.close()
        await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
        assert await asyncio.wait_for(task, 5) == [7]
        assert seen == ["/generate"]
    finally:
        filler.close()
        listener.close()
        await client.close()
        await runner.cleanup()
