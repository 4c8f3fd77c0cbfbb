"""SGLang stream chunk arithmetic: cumulative and incremental modes give the same tokens."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web

from areal_proxy.engine import EngineError, GenerationRequest
from areal_proxy.engine.base import collect
from areal_proxy.engine.sglang import SGLangClient


def _events(incremental: bool, ids: list[int]):
    out = []
    for n in range(1, len(ids) + 1):
        sl = ids[n - 1 : n] if incremental else ids[:n]
        finish = {"type": "length"} if n == len(ids) else None
        out.append(
            {
                "output_ids": sl,
                "meta_info": {
                    "completion_tokens": n,
                    "prompt_tokens": 2,
                    "finish_reason": finish,
                    "output_token_logprobs": [[-0.1 * t, t, None] for t in sl],
                    "weight_version": "3",
                },
            }
        )
    return out


async def _serve(aiohttp_server_factory, events):
    import orjson

    async def gen(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for e in events:
            await resp.write(b"data: " + orjson.dumps(e) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", gen)
    return await aiohttp_server_factory(app)


@pytest.fixture
async def server_factory():
    runners = []

    async def factory(app):
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    yield factory
    for r in runners:
        await r.cleanup()


@pytest.mark.parametrize("incremental", [False, True])
async def test_stream_modes_agree(server_factory, incremental):
    ids = [7, 8, 9, 10]
    url = await _serve(server_factory, _events(incremental, ids))
    client = SGLangClient(url)
    try:
        chunks = [c async for c in client.generate_stream(GenerationRequest([1, 2], 4))]
    finally:
        await client.close()
    out = collect(chunks)
    assert out.token_ids == ids
    assert out.logprobs == pytest.approx([-0.7, -0.8, -0.9, -1.0])
    assert out.finish_reason == "length"
    assert out.weight_version == "3"


async def test_stream_without_finish_is_an_error(server_factory):
    events = _events(False, [7, 8])
    events[-1]["meta_info"]["finish_reason"] = None
    url = await _serve(server_factory, events)
    client = SGLangClient(url)
    try:
        with pytest.raises(EngineError, match="without a finish reason after 2 tokens") as info:
            async for _ in client.generate_stream(GenerationRequest([1], 4)):
                pass
    finally:
        await client.close()
    assert info.value.lost  # the engine went away: the request may migrate


async def test_unreachable_engine_is_retryable_503():
    client = SGLangClient("http://127.0.0.1:9")
    try:
        with pytest.raises(EngineError) as info:
            await client.generate(GenerationRequest([1], 1))
    finally:
        await client.close()
    assert info.value.status == 503 and info.value.retryable and info.value.lost


async def test_a_connection_cut_mid_stream_is_lost_and_a_refusal_is_not(server_factory):
    async def cut(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: " + orjson.dumps(_events(True, [7, 8])[0]) + b"\n\n")
        assert request.transport is not None
        request.transport.abort()  # the engine process died
        return resp

    async def refuse(request):
        return web.json_response({"error": {"message": "too long", "code": 400}}, status=400)

    app = web.Application()
    app.router.add_post("/generate", cut)
    url = await server_factory(app)
    client = SGLangClient(url)
    try:
        with pytest.raises(EngineError) as info:
            async for _ in client.generate_stream(GenerationRequest([1], 4)):
                pass
        assert info.value.lost and info.value.status == 503, info.value
    finally:
        await client.close()
    app = web.Application()
    app.router.add_post("/generate", refuse)
    client = SGLangClient(await server_factory(app))
    try:
        with pytest.raises(EngineError) as info:
            async for _ in client.generate_stream(GenerationRequest([1], 4)):
                pass
        assert not info.value.lost
    finally:
        await client.close()


async def test_one_event_longer_than_aiohttps_line_limit(server_factory):
    # With incremental output SGLang coalesces what queued up while the proxy did not read
    # (a slow client's backpressure) into one event; with cumulative output every event holds
    # everything so far. Either way one line can pass the 512 KiB aiohttp allows a line here.
    ids = list(range(60_000))
    events = _events(True, ids[:1])
    events[0]["output_ids"] = ids
    events[0]["meta_info"]["output_token_logprobs"] = [[-0.5, t, None] for t in ids]
    events[0]["meta_info"]["completion_tokens"] = len(ids)
    events[0]["meta_info"]["finish_reason"] = {"type": "length"}
    url = await _serve(server_factory, events)
    client = SGLangClient(url)
    try:
        chunks = [c async for c in client.generate_stream(GenerationRequest([1], len(ids)))]
    finally:
        await client.close()
    out = collect(chunks)
    assert out.token_ids == ids and out.finish_reason == "length"


async def test_events_split_anywhere_in_transit(server_factory):
    ids = [7, 8, 9, 10, 11]
    body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in _events(True, ids))
    body += b"data: [DONE]\n\n"

    async def gen(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(0, len(body), 7):  # 7-byte writes: events and lines cut mid-way
            await resp.write(body[i : i + 7])
        return resp

    app = web.Application()
    app.router.add_post("/generate", gen)
    client = SGLangClient(await server_factory(app))
    try:
        chunks = [c async for c in client.generate_stream(GenerationRequest([1], 5))]
    finally:
        await client.close()
    assert collect(chunks).token_ids == ids


async def test_a_stream_that_skips_tokens_is_an_error(server_factory):
    events = _events(True, [7, 8, 9])
    del events[1]  # token 8 never arrives: the next event's offset is past what was read
    url = await _serve(server_factory, events)
    client = SGLangClient(url)
    try:
        with pytest.raises(EngineError, match="skipped"):
            async for _ in client.generate_stream(GenerationRequest([1], 3)):
                pass
    finally:
        await client.close()


async def _serve_in_one_write(server_factory, events):
    """Every event (and [DONE]) in one write: what the proxy finds in its buffer when the
    engine got ahead of it."""

    async def gen(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(
            b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        )
        return resp

    app = web.Application()
    app.router.add_post("/generate", gen)
    return await server_factory(app)


async def test_events_ready_together_make_one_chunk(server_factory):
    ids = [7, 8, 9, 10]
    url = await _serve_in_one_write(server_factory, _events(True, ids))
    client = SGLangClient(url)
    try:
        chunks = [c async for c in client.generate_stream(GenerationRequest([1, 2], 4))]
    finally:
        await client.close()
    assert len(chunks) == 1
    assert chunks[0].token_ids == ids
    assert chunks[0].logprobs == pytest.approx([-0.7, -0.8, -0.9, -1.0])
    assert chunks[0].finish_reason == "length"
    assert chunks[0].weight_version == "3"


async def test_a_new_weight_version_starts_a_new_chunk(server_factory):
    """Tokens read together keep their own weight version: a chunk has one version."""
    events = _events(True, [7, 8, 9, 10])
    events[2]["meta_info"]["weight_version"] = "4"
    events[3]["meta_info"]["weight_version"] = "4"
    url = await _serve_in_one_write(server_factory, events)
    client = SGLangClient(url)
    try:
        chunks = [c async for c in client.generate_stream(GenerationRequest([1, 2], 4))]
    finally:
        await client.close()
    assert [(c.token_ids, c.weight_version) for c in chunks] == [([7, 8], "3"), ([9, 10], "4")]
    assert [c.finish_reason for c in chunks] == [None, "length"]
