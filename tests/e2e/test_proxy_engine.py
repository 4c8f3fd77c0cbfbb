"""The real `areal-proxy` binary in front of a real SGLang engine on the CPU (parrot model).

The parrot repeats the last prompt token; with the ChatML template the last prompt token is
the "\\n" after "assistant", so a chat answer is newlines until max_tokens.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import pytest

from areal_cli import supervisor
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
PARROT = ROOT / "models" / "tiny-parrot"
CHATML_HELLO = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
MSG = [{"role": "user", "content": "hello"}]


@dataclass
class ProxyProc:
    popen: Any
    comp: supervisor.Component
    address: str
    log: Path
    info: dict[str, Any]


def _proxy_binary() -> str:
    return shutil.which("areal-proxy") or str(Path(sys.executable).parent / "areal-proxy")


def spawn_proxy(log_dir: Path, engine_url: str, name: str) -> ProxyProc:
    ready = log_dir / f"{name}.ready.json"
    log = log_dir / f"{name}.log"
    argv = [
        _proxy_binary(),
        "--engine-url",
        engine_url,
        "--model",
        "tiny-parrot",
        "--tokenizer-path",
        str(PARROT),
        "--proxy-id",
        name,
        "--ready-file",
        str(ready),
        "--log-level",
        "debug",
        "--drain-timeout",
        "20",
    ]
    popen, comp = supervisor.spawn(name, argv, log)

    def is_ready() -> bool:
        info = supervisor.read_ready_file(ready)
        return bool(info) and info.get("pid") == popen.pid

    try:
        supervisor.wait_ready(popen, comp, is_ready, 60)
    except BaseException:
        supervisor.terminate([[comp]], grace=2, procs={popen.pid: popen})
        raise
    info = supervisor.read_ready_file(ready) or {}
    return ProxyProc(popen, comp, f"{info['host']}:{info['port']}", log, info)


@pytest.fixture(scope="module")
def proxy(sglang_engine, tmp_path_factory) -> Iterator[ProxyProc]:
    p = spawn_proxy(tmp_path_factory.mktemp("proxy"), sglang_engine.url, "tiny-parrot-data-proxy-0")
    yield p
    supervisor.terminate([[p.comp]], grace=10, procs={p.popen.pid: p.popen})
    assert not supervisor.group_alive(p.comp)


@pytest.fixture
async def stub(proxy):
    async with grpc.aio.insecure_channel(proxy.address) as channel:
        yield proxy_pb2_grpc.InferenceProxyServiceStub(channel)


@pytest.fixture
async def status(proxy):
    async with grpc.aio.insecure_channel(proxy.address) as channel:
        yield proxy_pb2_grpc.ProxyStatusServiceStub(channel)


def req(body: dict[str, Any]) -> envelope_pb2.OpenAIRequest:
    return envelope_pb2.OpenAIRequest(
        envelope=envelope_pb2.Envelope(request_id="e2e"), body=orjson.dumps(body)
    )


def engine_generate(url: str, ids: list[int], max_new: int, top: int = 0) -> dict[str, Any]:
    """What the engine itself answers for the same prompt ids (greedy)."""
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "no_stop_trim": True},
        "return_logprob": True,
    }
    if top:
        body["top_logprobs_num"] = top
    r = httpx.post(url + "/generate", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def engine_running(url: str) -> int:
    loads = httpx.get(url + "/v1/loads", timeout=10).json()["loads"]
    return sum(int(x.get("num_running_reqs", 0)) for x in loads)


def chat_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def chat_lps(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]


async def test_chat_returns_the_engines_tokens(stub, sglang_engine, parrot_tokenizer):
    ids = parrot_tokenizer.encode(CHATML_HELLO).ids
    assert parrot_tokenizer.decode([ids[-1]]) == "\n"
    ref = engine_generate(sglang_engine.url, ids, 6, top=2)
    r = await stub.ChatCompletion(
        req(
            {
                "messages": MSG,
                "max_tokens": 6,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            }
        )
    )
    out = orjson.loads(r.body)
    choice = out["choices"][0]
    assert ref["output_ids"] == [ids[-1]] * 6
    assert choice["message"]["content"] == parrot_tokenizer.decode(ref["output_ids"]) == "\n" * 6
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 6,
        "total_tokens": len(ids) + 6,
    }
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [
        parrot_tokenizer.decode([t]) for t in ref["output_ids"]
    ]
    ref_lps = [t[0] for t in ref["meta_info"]["output_token_logprobs"]]
    assert [e["logprob"] for e in content] == pytest.approx(ref_lps, abs=1e-4)
    ref_top = ref["meta_info"]["output_top_logprobs"]
    for e, top in zip(content, ref_top, strict=True):
        assert [x["token"] for x in e["top_logprobs"]] == [
            parrot_tokenizer.decode([t[1]]) for t in top
        ]
        assert [x["logprob"] for x in e["top_logprobs"]] == pytest.approx(
            [t[0] for t in top], abs=1e-4
        )

    chunks = [
        orjson.loads(c.data)
        async for c in stub.ChatCompletionStream(
            req(
                {
                    "messages": MSG,
                    "max_tokens": 6,
                    "temperature": 0,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
        )
    ]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat_text(chunks) == choice["message"]["content"]
    assert [e["logprob"] for e in chat_lps(chunks)] == pytest.approx(
        [e["logprob"] for e in content], abs=1e-4
    )
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == out["usage"]
    # Real streaming, not one blob. Not exactly one chunk per token: when the scheduler
    # gets ahead of the tokenizer manager, SGLang hands over two tokens in one event.
    with_text = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert 2 <= len(with_text) <= 6


async def test_chat_stops_at_end_of_turn(stub, sglang_engine, parrot_tokenizer):
    # A conversation whose prompt ends in <|im_end|> makes the parrot say <|im_end|>: "stop".
    r = await stub.Completion(
        req({"prompt": [*parrot_tokenizer.encode("hi").ids, 2], "max_tokens": 5})
    )
    out = orjson.loads(r.body)
    assert out["choices"][0]["text"] == ""
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("prompt_kind", ["ids", "text", "list-of-text"])
async def test_completion_returns_the_engines_tokens(
    stub, sglang_engine, parrot_tokenizer, prompt_kind
):
    text = "hello world"
    ids = parrot_tokenizer.encode(text).ids
    prompt: Any = {"ids": ids, "text": text, "list-of-text": [text]}[prompt_kind]
    ref = engine_generate(sglang_engine.url, ids, 5)
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0}
    out = orjson.loads((await stub.Completion(req(body))).body)
    choice = out["choices"][0]
    assert choice["text"] == parrot_tokenizer.decode(ref["output_ids"])
    assert choice["logprobs"]["tokens"] == [parrot_tokenizer.decode([t]) for t in ref["output_ids"]]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [t[0] for t in ref["meta_info"]["output_token_logprobs"]], abs=1e-4
    )
    assert out["usage"]["prompt_tokens"] == len(ids)
    chunks = [
        orjson.loads(c.data) async for c in stub.CompletionStream(req({**body, "stream": True}))
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    streamed = [
        x
        for c in chunks
        if c["choices"][0]["logprobs"]
        for x in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"] == "length"


async def test_errors_are_openai_shaped(stub):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.ChatCompletion(req({"messages": MSG, "n": 0}))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = dict(ei.value.trailing_metadata())["areal-error-bin"]
    d = envelope_pb2.ErrorDetail.FromString(detail)
    assert (d.http_status, d.param) == (400, "n")


async def test_cancelling_a_stream_aborts_the_engine_request(stub, status, proxy, sglang_engine):
    # 3900 tokens take about ten seconds on this CPU; an aborted request is gone at once.
    body = {"messages": MSG, "max_tokens": 3900, "ignore_eos": True, "temperature": 0}
    call = stub.ChatCompletionStream(req(body))
    started = time.monotonic()
    for _ in range(5):
        assert await call.read() is not grpc.aio.EOF
    # The engine's load report is refreshed about once a second.
    deadline = time.monotonic() + 4
    while not engine_running(sglang_engine.url) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    before = engine_running(sglang_engine.url)
    assert before >= 1
    call.cancel()
    # (Compared with `before`, not 0: a shared engine may be serving someone else too.)
    deadline = time.monotonic() + 4
    while engine_running(sglang_engine.url) >= before and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert engine_running(sglang_engine.url) < before
    assert time.monotonic() - started < 8
    assert "aborting engine request" in proxy.log.read_text()
    stats = await status.GetStats(proxy_pb2.GetStatsRequest())
    assert stats.inflight_requests == 0


async def test_pause_mid_stream_then_continue_completes(stub, status, sglang_engine):
    n = 400
    body = {
        "messages": MSG,
        "max_tokens": n,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": True,
    }
    chunks: list[dict[str, Any]] = []
    paused_at = 0
    try:
        async for c in stub.ChatCompletionStream(req(body)):
            chunks.append(orjson.loads(c.data))
            if len(chunks) == 20 and not paused_at:
                r = await stub.Pause(proxy_pb2.PauseRequest())
                assert r.paused
                paused_at = len(chunks)
                stats = await status.GetStats(proxy_pb2.GetStatsRequest())
                assert stats.paused and stats.inflight_requests == 1

                async def resume_later() -> None:
                    await asyncio.sleep(0.5)
                    await stub.Continue(proxy_pb2.ContinueRequest())

                resumer = asyncio.create_task(resume_later())
    finally:
        await stub.Continue(proxy_pb2.ContinueRequest())
    await resumer
    assert paused_at
    assert chat_text(chunks) == "\n" * n
    assert len(chat_lps(chunks)) == n
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    stats = await status.GetStats(proxy_pb2.GetStatsRequest())
    assert not stats.paused and stats.healthy
    # The engine generates again after Continue.
    assert engine_generate(sglang_engine.url, [1, 5], 2)["output_ids"] == [5, 5]


async def test_pause_during_whole_answer_then_continue_completes(stub):
    n = 300
    body = {"messages": MSG, "max_tokens": n, "ignore_eos": True, "temperature": 0}

    async def call() -> Any:
        return await stub.ChatCompletion(req(body))

    task = asyncio.create_task(call())
    try:
        await asyncio.sleep(0.3)
        assert (await stub.Pause(proxy_pb2.PauseRequest())).paused
        await asyncio.sleep(0.3)
        assert not task.done()
    finally:
        await stub.Continue(proxy_pb2.ContinueRequest())
    out = orjson.loads((await asyncio.wait_for(task, 60)).body)
    assert out["choices"][0]["message"]["content"] == "\n" * n
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == n


def test_sigterm_drains_and_exits_zero(sglang_engine, tmp_path):
    p = spawn_proxy(tmp_path, sglang_engine.url, "tiny-parrot-data-proxy-sigterm")

    async def stream_then_term() -> list[dict[str, Any]]:
        async with grpc.aio.insecure_channel(p.address) as channel:
            s = proxy_pb2_grpc.InferenceProxyServiceStub(channel)
            body = {"messages": MSG, "max_tokens": 150, "ignore_eos": True, "temperature": 0}
            out = []
            async for c in s.ChatCompletionStream(req(body)):
                out.append(orjson.loads(c.data))
                if len(out) == 1:
                    os.killpg(p.comp.pgid, signal.SIGTERM)
            return out

    try:
        chunks = asyncio.run(stream_then_term())
        assert chat_text(chunks) == "\n" * 150  # the in-flight stream was drained, not cut
        assert p.popen.wait(timeout=30) == 0
    finally:
        supervisor.terminate([[p.comp]], grace=5, procs={p.popen.pid: p.popen})
    log = p.log.read_text()
    assert "draining 1 request(s)" in log and "stopped" in log
