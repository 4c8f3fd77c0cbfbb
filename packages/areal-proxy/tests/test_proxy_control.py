"""Pause / continue with token-preserving resubmission, weight versions, deadlines,
cancellation, engine failures, stats, drain and the internal token."""

from __future__ import annotations

import asyncio
import time

import grpc
import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, error_detail, request, start, wait_for

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proxy.engine.base import EngineError

MSG = [{"role": "user", "content": "hi"}]
SEQ = [*range(40, 60), EOS]  # 21 tokens, ends with the end-of-turn token


async def _pause_after(h, n_tokens: int) -> None:
    await wait_for(lambda: h.engine.tokens_sent >= n_tokens)
    r = await h.stub.Pause(proxy_pb2.PauseRequest())
    assert r.paused


@pytest.mark.parametrize("stream", [True, False])
async def test_pause_resubmits_and_versions_switch(stream):
    engine = FakeEngineClient(SEQ, delay=0.01)
    h = await start(engine)
    try:
        body = {"messages": MSG, "logprobs": True, "max_tokens": 50}
        call = h.chat_stream(body) if stream else h.chat(body)
        task = asyncio.create_task(call)
        await _pause_after(h, 5)
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert stats.paused and stats.inflight_requests == 1
        await asyncio.sleep(0.1)
        assert not task.done()  # the client waits; nothing failed
        await h.stub.SetVersion(proxy_pb2.SetVersionRequest(version=7))
        r = await h.stub.Continue(proxy_pb2.ContinueRequest())
        assert not r.paused and r.version == 7
        out = await asyncio.wait_for(task, 5)

        (rec,) = h.records
        assert rec.token_ids == SEQ and rec.finish_reason == "stop"
        k = len(engine.requests[0].input_ids)
        first, second = engine.requests
        done = len(second.input_ids) - k
        assert 5 <= done < len(SEQ)
        assert second.input_ids == first.input_ids + SEQ[:done]
        assert second.max_new_tokens == 50 - done and second.rid != first.rid
        assert rec.versions == [0] * done + [7] * (len(SEQ) - done)
        assert rec.attempts == 2
        text = h.tok.decode(SEQ[:-1])
        if stream:
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in out) == text
            assert out[-1]["choices"][0]["finish_reason"] == "stop"
            lps = [
                e["logprob"]
                for c in out
                if c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]
            ]
            assert len(lps) == len(SEQ)
        else:
            assert out["choices"][0]["message"]["content"] == text
            assert out["usage"]["completion_tokens"] == len(SEQ)
            assert len(out["choices"][0]["logprobs"]["content"]) == len(SEQ)
        assert engine.pause_calls == 1 and engine.resume_calls == 1
    finally:
        await h.close()


async def test_new_requests_wait_while_paused():
    engine = FakeEngineClient([5, EOS])
    h = await start(engine)
    try:
        await h.stub.Pause(proxy_pb2.PauseRequest())
        # Bounded by its deadline.
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.stub.ChatCompletion(
                request({"messages": MSG}, deadline_ms=int(time.time() * 1000) + 200)
            )
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert error_detail(ei.value).http_status == 504
        assert engine.requests == []
        task = asyncio.create_task(h.chat({"messages": MSG}))
        await asyncio.sleep(0.1)
        assert not task.done() and engine.requests == []
        await h.stub.Continue(proxy_pb2.ContinueRequest())
        out = await asyncio.wait_for(task, 5)
        assert out["choices"][0]["finish_reason"] == "stop"
    finally:
        await h.close()


async def test_update_weights_pauses_loads_bumps_and_continues():
    engine = FakeEngineClient(SEQ, delay=0.01)
    h = await start(engine)
    try:
        task = asyncio.create_task(h.chat_stream({"messages": MSG}))
        await wait_for(lambda: engine.tokens_sent >= 3)
        r = await h.stub.UpdateWeights(proxy_pb2.UpdateWeightsRequest(path="/ckpt/1", version=-1))
        assert (r.version, r.paused) == (1, False)
        assert engine.updates == [("/ckpt/1", "1")]
        await asyncio.wait_for(task, 5)
        (rec,) = h.records
        assert rec.token_ids == SEQ
        assert rec.versions[0] == 0 and rec.versions[-1] == 1
        assert rec.versions == sorted(rec.versions)
        r = await h.stub.UpdateWeights(proxy_pb2.UpdateWeightsRequest(path="/ckpt/9", version=9))
        assert r.version == 9
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert (stats.version, stats.paused) == (9, False)
    finally:
        await h.close()


async def test_update_weights_failure_keeps_version_and_continues():
    engine = FakeEngineClient([5, EOS], fail_update=EngineError("bad checkpoint", status=502))
    h = await start(engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.stub.UpdateWeights(proxy_pb2.UpdateWeightsRequest(path="/bad", version=-1))
        d = error_detail(ei.value)
        assert d.http_status == 502 and "bad checkpoint" in d.message
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert (stats.version, stats.paused) == (0, False)
        assert engine.resume_calls == 1
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.stub.UpdateWeights(proxy_pb2.UpdateWeightsRequest(path=""))
        assert error_detail(ei.value).param == "path"
    finally:
        await h.close()


async def test_update_weights_while_paused_stays_paused():
    engine = FakeEngineClient([5, EOS])
    h = await start(engine)
    try:
        await h.stub.Pause(proxy_pb2.PauseRequest())
        r = await h.stub.UpdateWeights(proxy_pb2.UpdateWeightsRequest(path="/ckpt", version=3))
        assert (r.version, r.paused) == (3, True)
        await h.stub.Continue(proxy_pb2.ContinueRequest())
    finally:
        await h.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_deadline_aborts_engine_request(stream):
    engine = FakeEngineClient(SEQ * 10, delay=0.05)
    h = await start(engine)
    try:
        req = request({"messages": MSG}, deadline_ms=int(time.time() * 1000) + 300)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            if stream:
                async for _ in h.stub.ChatCompletionStream(req):
                    pass
            else:
                await h.stub.ChatCompletion(req)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        d = error_detail(ei.value)
        assert d.http_status == 504 and d.code == "deadline_exceeded"
        await wait_for(lambda: engine.aborted)
        assert engine.aborted == [engine.requests[0].rid]
    finally:
        await h.close()


async def test_request_timeout_setting_is_a_deadline():
    engine = FakeEngineClient(SEQ * 10, delay=0.05)
    h = await start(engine, request_timeout=0.2)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.stub.Completion(request({"prompt": "x"}))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await h.close()


async def test_grpc_deadline_aborts_engine_request():
    engine = FakeEngineClient(SEQ * 10, delay=0.05)
    h = await start(engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.stub.ChatCompletion(request({"messages": MSG}), timeout=0.3)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: engine.aborted)
    finally:
        await h.close()


async def test_client_cancel_aborts_engine_request():
    engine = FakeEngineClient(SEQ * 10, delay=0.02)
    h = await start(engine)
    try:
        call = h.stub.ChatCompletionStream(request({"messages": MSG}))
        got = 0
        async for _ in call:
            got += 1
            if got == 3:
                break
        call.cancel()
        await wait_for(lambda: engine.aborted)
        assert engine.aborted == [engine.requests[0].rid]
        await wait_for(lambda: h.server.servicer.active == 0)
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert stats.inflight_requests == 0 and stats.inflight_tokens == 0
    finally:
        await h.close()


@pytest.mark.parametrize(
    ("status", "code"), [(503, grpc.StatusCode.UNAVAILABLE), (502, grpc.StatusCode.INTERNAL)]
)
async def test_engine_failure_is_not_retried(status, code):
    engine = FakeEngineClient([5, EOS], fail=EngineError("engine down", status=status))
    h = await start(engine)
    try:
        for call in (h.stub.ChatCompletion, h.stub.Completion):
            body = {"messages": MSG} if call is h.stub.ChatCompletion else {"prompt": "x"}
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call(request(body))
            assert ei.value.code() == code
            assert error_detail(ei.value).http_status == status
        assert len(engine.requests) == 2  # one per request: never retried
    finally:
        await h.close()


async def test_stats_report_load():
    engine = FakeEngineClient(SEQ, delay=0.05)
    h = await start(engine, proxy_id="tiny-parrot-data-proxy-0")
    try:
        task = asyncio.create_task(h.chat({"messages": MSG, "max_tokens": 30}))
        await wait_for(lambda: engine.tokens_sent >= 2)
        s = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        prompt = len(engine.requests[0].input_ids)
        assert s.healthy and not s.draining and s.inflight_requests == 1
        assert s.inflight_tokens == prompt + 30  # non-stream: tokens arrive at the end
        assert (s.model, s.engine_url, s.total_requests) == ("tiny-parrot", "http://fake-engine", 1)
        await task
        s = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert s.inflight_requests == 0 and s.inflight_tokens == 0
        engine.healthy = False
        await h.server._check_engine()
        s = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert not s.healthy and "health" in s.detail
    finally:
        await h.close()


async def test_drain_finishes_inflight_and_refuses_new_work():
    engine = FakeEngineClient(SEQ, delay=0.02)
    h = await start(engine)
    task = asyncio.create_task(h.chat_stream({"messages": MSG}))
    await wait_for(lambda: engine.tokens_sent >= 2)
    stub, channel = h.stub, h.channel
    shutdown = asyncio.create_task(h.server.shutdown())
    await wait_for(lambda: h.server.state.draining)
    s = await h.status.GetStats(proxy_pb2.GetStatsRequest())
    assert s.draining
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.ChatCompletion(request({"messages": MSG}))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_detail(ei.value).code == "draining"
    chunks = await asyncio.wait_for(task, 5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    await asyncio.wait_for(shutdown, 5)
    assert engine.closed
    await channel.close()


async def test_internal_token_required(monkeypatch):
    monkeypatch.setenv("AREAL_INTERNAL_TOKEN", "s3cret-token-value")
    engine = FakeEngineClient([5, EOS])
    h = await start(engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.stub.Pause(
                proxy_pb2.PauseRequest(), metadata=(("x-areal-internal-token", "wrong"),)
            )
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        md = (("x-areal-internal-token", "s3cret-token-value"),)
        r = await h.stub.ChatCompletion(request({"messages": MSG}), metadata=md)
        assert orjson.loads(r.body)["choices"][0]["finish_reason"] == "stop"
    finally:
        await h.close()


async def test_health_service_and_only_inference_services_served():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    h = await start(FakeEngineClient([5, EOS]))
    try:
        health_stub = health_pb2_grpc.HealthStub(h.channel)
        for name in (
            "",
            "areal.proxy.v1.InferenceProxyService",
            "areal.proxy.v1.ProxyStatusService",
        ):
            r = await health_stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        # The agent-mode service is not registered at all: gRPC itself says UNIMPLEMENTED.
        agent = proxy_pb2_grpc.AgentProxyServiceStub(h.channel)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await agent.GetAgentHistory(proxy_pb2.GetAgentHistoryRequest(session_id="s"))
        assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await h.close()


async def test_metrics_endpoint_counts_requests_and_tokens():
    import urllib.request

    engine = FakeEngineClient([5, 6, EOS])
    h = await start(engine, metrics_port=0)
    try:
        await h.chat({"messages": MSG})
        with pytest.raises(grpc.aio.AioRpcError):
            await h.stub.ChatCompletion(request({"messages": []}))
        url = f"http://127.0.0.1:{h.server.metrics_port}/metrics"
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=5).read().decode()
        )
        assert 'areal_proxy_requests_total{rpc="ChatCompletion",status="200"} 1.0' in text
        assert 'areal_proxy_requests_total{rpc="ChatCompletion",status="400"} 1.0' in text
        assert 'areal_proxy_completion_tokens_total{model="tiny-parrot"} 3.0' in text
        assert "areal_proxy_time_to_first_token_seconds_count 1.0" in text
        assert "areal_proxy_inflight_requests 0.0" in text
    finally:
        await h.close()


class _InTransitEngine(FakeEngineClient):
    """Makes a request's whole output as soon as it is sent: the chunks are then in transit,
    read whenever the proxy gets to them, even after a pause and a weight update."""

    async def generate_stream(self, req):  # type: ignore[override]
        made = [c async for c in super().generate_stream(req)]
        for chunk in made:
            yield chunk

    async def generate(self, req):  # type: ignore[override]
        result = await super().generate(req)
        await asyncio.sleep(0.1)  # the answer is on its way
        return result


@pytest.mark.parametrize("stream", [True, False])
async def test_tokens_read_after_a_weight_update_keep_the_version_that_made_them(stream):
    from areal_proxy.engine.base import GenerationRequest
    from areal_proxy.generation.controller import GenerationController

    engine = _InTransitEngine(SEQ)
    controller = GenerationController(engine)
    rec = controller.start([1, 2, 3], 10)
    template = GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=10)
    if stream:
        steps = controller.stream(rec, template)
        await steps.__anext__()  # one token read; the engine has made all ten
        assert await controller.update_weights("/new/weights") == 1
        async for _ in steps:
            pass
    else:
        task = asyncio.create_task(controller.generate(rec, template))
        await wait_for(lambda: engine.tokens_sent == 10)  # made; the answer not yet read
        assert await controller.update_weights("/new/weights") == 1
        await task
    assert rec.token_ids == SEQ[:10] and rec.versions == [0] * 10
    controller.finish(rec)
