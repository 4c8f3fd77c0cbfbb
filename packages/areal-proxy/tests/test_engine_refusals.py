"""An engine's refusal of the request is the client's 400 naming what to change, not a 502
(which an OpenAI SDK retries); and the proxy checks prompts against what the engine takes,
learned from the engine, not only against the model's context.

The engine bodies are SGLang 0.5.23's own, captured from the CPU engine serving SmolLM2 with
--max-total-tokens 4096 (max_req_input_len 4090, context 8192)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import orjson
import pytest
from aiohttp import web
from proxy_fakes import EOS, FakeEngineClient, error_detail, request, start

from areal_proxy.engine import EngineError, GenerationRequest
from areal_proxy.engine import refusals as rf
from areal_proxy.engine.sglang import SGLangClient
from areal_proxy.engine.vllm import _error as vllm_error
from areal_proxy.engine.vllm import _stream_error as vllm_stream_error

SCHEMA_400 = {
    "error": {
        "message": "Failed to compile structural_tag grammar: [08:48:25] "
        '/project/cpp/json_schema_converter.cc:4175: Unsupported type "objekt"\n'
    }
}
TOO_LONG = (
    "Input length (5021 tokens) exceeds the maximum allowed length (4090 tokens). "
    "Use a shorter input or enable --allow-auto-truncate."
)


def _abort_event(message: str, status_code: int | None) -> dict[str, Any]:
    # What SGLang streams for a request it refuses: one junk token and an abort.
    return {
        "text": "",
        "output_ids": [0],
        "meta_info": {
            "finish_reason": {
                "type": "abort",
                "message": message,
                "status_code": status_code,
                "err_type": "BadRequestError" if status_code else None,
            },
            "prompt_tokens": 1,
            "completion_tokens": 1,
        },
    }


Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def factory(app: web.Application) -> str:
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


def _sglang_app(*, status: int = 200, body: Any = None, events: list[Any] | None = None):
    async def generate(request: web.Request) -> web.StreamResponse:
        if events is None:
            return web.json_response(body, status=status)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for e in events:
            await resp.write(b"data: " + orjson.dumps(e) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"max_total_num_tokens": 4096, "max_req_input_len": 4090})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_server_info", server_info)
    return app


# ---- the engine clients ---------------------------------------------------------------


async def test_sglang_schema_refusal_is_a_clean_400_constraint_refusal(serve):
    client = SGLangClient(await serve(_sglang_app(status=400, body=SCHEMA_400)))
    try:
        with pytest.raises(EngineError) as info:
            await client.generate(GenerationRequest([1, 2], 4))
    finally:
        await client.close()
    e = info.value
    assert (e.status, e.refused, e.lost, e.retryable) == (400, rf.CONSTRAINT, False, False)
    assert 'Unsupported type "objekt"' in str(e)
    assert "/project/cpp" not in str(e) and "08:48:25" not in str(e)


@pytest.mark.parametrize("status_code", [400, None])
async def test_sglang_streamed_refusal_is_an_error_not_an_aborted_token(serve, status_code):
    """SGLang refuses a streamed request with a 200 stream whose one event aborts with status
    400 (and a junk token); an abort without a status is the proxy's own (pause, abort)."""
    app = _sglang_app(events=[_abort_event(TOO_LONG, status_code)])
    client = SGLangClient(await serve(app))
    chunks = []
    try:
        if status_code is None:
            chunks = [c async for c in client.generate_stream(GenerationRequest([1], 4))]
            assert chunks[-1].finish_reason == "abort"
            return
        with pytest.raises(EngineError) as info:
            async for c in client.generate_stream(GenerationRequest([1], 4)):
                chunks.append(c)
    finally:
        await client.close()
    assert chunks == []
    assert (info.value.status, info.value.refused) == (400, rf.PROMPT)
    assert "--allow-auto-truncate" not in str(info.value)  # the engine operator's advice


async def test_sglang_context_limit_is_its_max_req_input_len(serve):
    client = SGLangClient(await serve(_sglang_app()))
    try:
        assert await client.context_limit() == 4090
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("Invalid structural tag specification.", rf.CONSTRAINT),
        ("Failed to transform json schema into a grammar: bad", rf.CONSTRAINT),
        (
            "The decoder prompt (length 3000) is longer than the maximum model length of 2048. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens.",
            rf.PROMPT,
        ),
        ("temperature must be non-negative", rf.REQUEST),
    ],
)
def test_vllm_refusals_are_told_apart(message, kind):
    body = orjson.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}})
    for e in (
        vllm_error(body, 400, "/v1/completions"),
        vllm_stream_error({"error": {"message": message, "code": 400}}),
    ):
        assert (e.status, e.refused) == (400, kind)
    assert vllm_error(body, 500, "/v1/completions").refused == ""


# ---- through the proxy ----------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_schema_is_a_400_naming_response_format(stream):
    engine = FakeEngineClient([5, EOS], fail=rf.refusal(SCHEMA_400["error"]["message"]))
    h = await start(engine)
    try:
        body = {"messages": MSG, "response_format": BAD_SCHEMA}
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if stream:
                await h.chat_stream(body)
            else:
                await h.chat(body)
        d = error_detail(info.value)
        assert (d.http_status, d.type, d.param) == (400, "invalid_request_error", "response_format")
        assert 'Unsupported type "objekt"' in d.message and "fix it" in d.message
        assert "/project/cpp" not in d.message
    finally:
        await h.close()


async def test_a_refused_tool_schema_under_a_forced_choice_names_tools():
    engine = FakeEngineClient([5, EOS], fail=rf.refusal(SCHEMA_400["error"]["message"]))
    h = await start(engine, tool_call_parser="hermes")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.chat({"messages": MSG, "tools": [tool], "tool_choice": "required"})
        assert error_detail(info.value).param == "tools"
    finally:
        await h.close()


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", {"messages": MSG}, "messages"),
        ("completion", {"prompt": "hi"}, "prompt"),
        ("completion", {"prompt": ["hi", "ho"]}, "prompt[0]"),
    ],
)
async def test_a_prompt_the_engine_refuses_as_too_long_names_the_prompt(endpoint, body, param):
    h = await start(FakeEngineClient([5, EOS], fail=rf.refusal(TOO_LONG)))
    try:
        call = h.stub.ChatCompletion if endpoint == "chat" else h.stub.Completion
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(request(body))
        d = error_detail(info.value)
        assert (d.http_status, d.code, d.param) == (400, "context_length_exceeded", param)
        assert f"shorten '{param}'" in d.message
    finally:
        await h.close()


async def test_an_engine_failure_is_still_the_engines_error():
    h = await start(FakeEngineClient([5, EOS], fail=EngineError("boom", status=502)))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.chat({"messages": MSG})
        assert error_detail(info.value).http_status == 502
    finally:
        await h.close()


class LimitedEngine(FakeEngineClient):
    """An engine that takes fewer tokens than the model's context (SGLang's KV cache)."""

    def __init__(self, limit: int | Exception) -> None:
        super().__init__([5, 6, 7, EOS])
        self.limit = limit
        self.asked = 0

    async def context_limit(self) -> int:
        self.asked += 1
        if isinstance(self.limit, Exception):
            raise self.limit
        return self.limit


async def test_the_engines_smaller_limit_is_learned_at_start_and_wins():
    engine = LimitedEngine(40)
    h = await start(engine)  # the parrot model's own context is 2048
    try:
        assert engine.asked == 1
        long_prompt = list(range(10, 60))  # 50 ids
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.completion({"prompt": long_prompt, "max_tokens": 4})
        d = error_detail(info.value)
        assert (d.http_status, d.code, d.param) == (400, "context_length_exceeded", "prompt")
        assert "fewer than 40 tokens" in d.message and "--max-total-tokens" in d.message
        assert engine.requests == []  # refused before the engine saw it
        # An answer's budget is capped by what is left of the engine's limit, not the model's.
        await h.completion({"prompt": list(range(10, 40)), "max_tokens": 100})
        assert engine.requests[-1].max_new_tokens == 40 - 30
    finally:
        await h.close()


async def test_a_larger_engine_limit_changes_nothing_and_the_flag_still_caps():
    h = await start(LimitedEngine(100_000), context_length=64, engine_max_tokens=3)
    try:
        assert h.server.servicer.handler.context_length == 64
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.completion({"prompt": list(range(10, 80))})
        assert "context length is 64" in error_detail(info.value).message
        await h.completion({"prompt": [10, 11], "max_tokens": 50})
        assert h.engine.requests[-1].max_new_tokens == 3
    finally:
        await h.close()


async def test_an_engine_that_does_not_answer_is_asked_again_at_the_next_check():
    engine = LimitedEngine(EngineError("no answer", status=503))
    h = await start(engine)
    handler = h.server.servicer.handler
    try:
        assert handler.context_length == 2048 and engine.asked == 1
        engine.limit = 30
        await h.server._check_engine()  # the next background health check
        assert handler.context_length == 30 and engine.asked == 2
        await h.server._check_engine()  # known now: not asked on every check
        assert engine.asked == 2
    finally:
        await h.close()
