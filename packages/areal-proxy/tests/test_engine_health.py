"""A request that loses the engine makes it suspect, never down for longer than it does not
answer; a client that goes away says nothing about the engine (a harness's retry
after a cut stream was refused for seconds while the engine was fine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proxy_fakes import EOS, FakeEngineClient, request, start, wait_for

from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.engine.base import EngineError, GenerationChunk, GenerationRequest

MSG = [{"role": "user", "content": "hi"}]
SEQ = [*range(40, 60), EOS]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class CuttingEngine(FakeEngineClient):
    """Cuts the next `cuts` streams after two tokens, as a dropped engine connection does
    (SGLangClient's 503 `lost`); counts its health checks."""

    def __init__(self, sequence: list[int], **kw: Any) -> None:
        super().__init__(sequence, **kw)
        self.cuts = 0
        self.checks = 0

    async def health(self) -> bool:
        self.checks += 1
        return self.healthy

    async def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        cut, self.cuts = self.cuts > 0, max(0, self.cuts - 1)
        n = 0
        async for chunk in super().generate_stream(req):
            yield chunk
            n += 1
            if cut and n == 2:
                raise EngineError(
                    "engine connection lost at http://fake-engine after 2 tokens",
                    status=503,
                    lost=True,
                )


async def _stats(h: Any) -> proxy_pb2.ProxyStats:
    return await h.status.GetStats(proxy_pb2.GetStatsRequest(), timeout=1.0)


async def _cut_stream(h: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.chat_stream({"messages": MSG})
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_cut_engine_stream_is_checked_at_once_and_an_answering_engine_stays_healthy():
    # The background check is a minute away (proxy_fakes): only the check the cut starts can
    # say the engine is back.
    engine = CuttingEngine(SEQ, delay=0.005)
    h = await start(engine)
    try:
        checks = engine.checks
        engine.cuts = 1
        await _cut_stream(h)
        # The router's next poll hears what the engine says now, not "unhealthy" until the
        # next background check.
        s = await _stats(h)
        assert s.healthy and s.detail == ""
        assert engine.checks > checks, "the cut did not make the proxy ask its engine"
        # The retry goes through.
        chunks = await h.chat_stream({"messages": MSG})
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        await h.close()


async def test_an_engine_that_does_not_answer_after_a_cut_is_unhealthy_until_it_answers():
    engine = CuttingEngine(SEQ, delay=0.005)
    h = await start(engine)
    health = health_pb2_grpc.HealthStub(h.channel)
    seen: list[int] = []

    async def watch() -> None:
        async for r in health.Watch(health_pb2.HealthCheckRequest(service="")):
            seen.append(r.status)

    watcher = asyncio.create_task(watch())
    try:
        await wait_for(lambda: seen == [SERVING])
        engine.cuts = 1
        engine.healthy = False  # it is really gone
        await _cut_stream(h)
        s = await _stats(h)
        assert not s.healthy and "health check" in s.detail
        # Said on the health stream too, so that its coming back can be said there.
        await wait_for(lambda: seen == [SERVING, NOT_SERVING])
        engine.healthy = True
        # Asked again by the next poll (the background check is a minute away).
        s = await _stats(h)
        assert s.healthy
        await wait_for(lambda: seen == [SERVING, NOT_SERVING, SERVING])
    finally:
        watcher.cancel()
        await h.close()


async def test_a_failure_during_a_check_that_started_before_it_is_checked_again():
    """A check already on its way may have asked before the engine went: its "healthy" does
    not clear a failure that came after it started."""

    class SlowCheck(CuttingEngine):
        def __init__(self, sequence: list[int]) -> None:
            super().__init__(sequence)
            self.release = asyncio.Event()
            self.answers: list[bool] = []

        async def health(self) -> bool:
            self.checks += 1
            if self.checks == 2:  # the first check after start: held while the engine dies
                answer = self.healthy
                await self.release.wait()
                return answer
            return self.healthy

    engine = SlowCheck(SEQ)
    h = await start(engine)
    try:
        early = h.server.engine_health.check()
        await wait_for(lambda: engine.checks == 2)
        engine.healthy = False
        h.server.servicer._error(EngineError("engine connection lost", status=503, lost=True))
        engine.release.set()
        await early
        assert not h.server.state.engine_healthy
        assert "health check" in h.server.state.engine_detail
    finally:
        await h.close()


async def test_a_client_that_goes_away_mid_stream_says_nothing_about_the_engine():
    engine = CuttingEngine([*range(40, 60)] * 10 + [EOS], delay=0.01)
    h = await start(engine)
    try:
        checks = engine.checks
        # One call per request (--no-proxy-streams): the gateway cancels the call.
        call = h.stub.ChatCompletionStream(request({"messages": MSG, "stream": True}))
        got = 0
        async for _ in call:
            got += 1
            if got == 3:
                call.cancel()
                break
        await wait_for(lambda: len(engine.aborted) == 1)
        # The multiplexed stream: the gateway sends a cancel frame.
        mux = h.stub.Generate()
        req = request({"messages": MSG})
        req.envelope.stream = True
        await mux.write(
            proxy_pb2.GenerateFrames(
                frames=[
                    proxy_pb2.GenerateFrame(id=1, kind=proxy_pb2.GENERATE_KIND_CHAT, request=req)
                ]
            )
        )
        sent = engine.tokens_sent
        await wait_for(lambda: engine.tokens_sent >= sent + 3)
        await mux.write(
            proxy_pb2.GenerateFrames(frames=[proxy_pb2.GenerateFrame(id=1, cancel=True)])
        )
        await wait_for(lambda: len(engine.aborted) == 2)
        await mux.done_writing()
        mux.cancel()
        s = await _stats(h)
        assert s.healthy and h.server.state.engine_healthy
        assert engine.checks == checks, "a client's cancel made the proxy doubt its engine"
    finally:
        await h.close()
