"""Graceful drain of a replica: `Retire` sends new work to a peer's engine at once,
lets the requests on its own engine finish within the drain timeout, then moves the rest on
with the tokens they have; the retired proxy keeps serving (and recording) on its peers."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from peer_fakes import cluster, count, streamed_text
from proxy_fakes import EOS, FakeEngineClient, Harness, error_detail, lp_of, start, wait_for

from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.engine.base import GenerationRequest
from areal_proxy.engine.peer import sampling_json

MSG = [{"role": "user", "content": "hi"}]
SEQ = [*range(40, 80), EOS]  # 41 tokens, ends with the end-of-turn token


def _align(peer: FakeEngineClient, h: Harness) -> None:
    """The peer continues SEQ wherever a moved request left it (the fake engine counts its
    position from the prompt's length, known once the first proxy's engine saw it)."""
    peer._prompt_len = len(h.engine.requests[0].input_ids)


async def _retire(h: Harness, drain_timeout: float) -> proxy_pb2.RetireResponse:
    return await h.stub.Retire(proxy_pb2.RetireRequest(drain_timeout_s=drain_timeout))


async def test_requests_on_the_engine_finish_there_and_new_ones_go_to_a_peer():
    local = FakeEngineClient(SEQ, delay=0.01)
    peer = FakeEngineClient(SEQ)
    async with cluster(local, [peer]) as (p1, _, _):
        running = asyncio.create_task(
            p1.chat_stream({"messages": MSG, "max_tokens": 60, "stream": True, "logprobs": True})
        )
        await wait_for(lambda: local.tokens_sent >= 3)
        retire = asyncio.create_task(_retire(p1, 10.0))
        await wait_for(lambda: p1.server.controller.retired)
        # A new request while the drain runs: on the peer, from its prompt.
        out = await p1.chat({"messages": MSG, "max_tokens": 60})
        assert out["choices"][0]["message"]["content"] == p1.tok.decode(SEQ[:-1])
        (moved,) = peer.requests
        assert moved.input_ids == local.requests[0].input_ids
        assert len(local.requests) == 1  # the engine took nothing new
        chunks = await running
        done = await retire
        assert (done.finished, done.moved, done.failed) == (1, 0, 0)
        assert streamed_text(chunks) == p1.tok.decode(SEQ[:-1])
        first = next(r for r in p1.records if r.replicas == [(0, "")])
        assert first.token_ids == SEQ and first.finish_reason == "stop"
        second = next(r for r in p1.records if r is not first)
        assert second.token_ids == SEQ and second.replicas == [(0, "p2")]
        stats = await p1.status.GetStats(proxy_pb2.GetStatsRequest())
        assert stats.retired and stats.draining and "retired" in stats.detail


@pytest.mark.parametrize("stream", [True, False])
async def test_what_outlasts_the_drain_timeout_moves_on_with_its_tokens(stream):
    local = FakeEngineClient(SEQ, delay=0.03)
    peer = FakeEngineClient(SEQ)
    async with cluster(local, [peer]) as (p1, (p2,), _):
        await p2.stub.SetVersion(proxy_pb2.SetVersionRequest(version=5))
        body: dict[str, Any] = {"messages": MSG, "max_tokens": 60, "logprobs": True}
        call = p1.chat_stream({**body, "stream": True}) if stream else p1.chat(body)
        running = asyncio.create_task(call)
        await wait_for(lambda: local.tokens_sent >= 4)
        _align(peer, p1)
        done = await _retire(p1, 0.1)
        assert (done.finished, done.moved, done.failed) == (0, 1, 0)
        out = await running
        text = streamed_text(out) if stream else out["choices"][0]["message"]["content"]
        assert text == p1.tok.decode(SEQ[:-1])
        (rec,) = p1.records
        k = rec.replicas[1][0]
        assert 4 <= k < len(SEQ)
        assert rec.replicas == [(0, ""), (k, "p2")]
        assert rec.token_ids == SEQ and rec.logprobs == [lp_of(t) for t in SEQ]
        assert rec.versions == [0] * k + [5] * (len(SEQ) - k)
        (cont,) = peer.requests
        assert cont.input_ids == local.requests[0].input_ids + SEQ[:k]
        assert cont.max_new_tokens == 60 - k
        assert local.aborted == [local.requests[0].rid]
        assert count(p1, "continued") == 1


async def test_a_constrained_generation_with_output_cannot_move_and_is_counted():
    local = FakeEngineClient(SEQ, delay=0.03)
    peer = FakeEngineClient(SEQ)
    async with cluster(local, [peer]) as (p1, _, _):
        body = {
            "messages": MSG,
            "max_tokens": 60,
            "stream": True,
            "response_format": {"type": "json_object"},
        }
        running = asyncio.create_task(p1.chat_stream(body))
        await wait_for(lambda: local.tokens_sent >= 2)
        done = await _retire(p1, 0.0)
        assert (done.moved, done.failed) == (1, 1)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await running
        d = error_detail(ei.value)
        assert d.code == "migration_failed" and "constrained" in d.message
        assert "retired" in d.message
        assert peer.requests == []


async def test_a_retired_proxy_serves_new_choices_on_peers_and_refuses_continuations():
    peer = FakeEngineClient(SEQ)
    async with cluster(FakeEngineClient(SEQ), [peer]) as (p1, _, _):
        assert (await _retire(p1, 1.0)).finished == 0
        out = await p1.chat({"messages": MSG, "max_tokens": 60, "n": 2})
        assert [c["finish_reason"] for c in out["choices"]] == ["stop", "stop"]
        assert len(peer.requests) == 2 and p1.engine.requests == []
        # Another replica must not continue its requests here: it has no engine to give.
        req = GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=5)
        msg = proxy_pb2.ContinueGenerationRequest(
            input_ids=[1, 2, 3], max_new_tokens=5, sampling=sampling_json(req)
        )
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in p1.stub.ContinueGeneration(msg):
                pass
        assert error_detail(ei.value).code == "engine_lost"
        # Idempotent.
        again = await _retire(p1, 1.0)
        assert (again.finished, again.moved, again.failed) == (0, 0, 0)


async def test_a_retired_proxy_leaves_its_engine_alone_for_control_calls():
    local = FakeEngineClient(SEQ)
    async with cluster(local, [FakeEngineClient(SEQ)]) as (p1, _, _):
        await _retire(p1, 1.0)
        await p1.stub.Pause(proxy_pb2.PauseRequest())
        await p1.stub.Continue(proxy_pb2.ContinueRequest())
        r = await p1.stub.UpdateWeights(proxy_pb2.UpdateWeightsRequest(path="/ckpt", version=-1))
        assert r.version == 1 and not r.paused
        assert (local.pause_calls, local.updates) == (0, [])


async def test_a_proxy_started_retired_never_uses_its_engine():
    peer = FakeEngineClient(SEQ)
    async with cluster(FakeEngineClient(SEQ), [peer], retired=True) as (p1, _, _):
        out = await p1.chat({"messages": MSG, "max_tokens": 60})
        assert out["choices"][0]["message"]["content"] == p1.tok.decode(SEQ[:-1])
        assert p1.engine.requests == [] and len(peer.requests) == 1
        stats = await p1.status.GetStats(proxy_pb2.GetStatsRequest())
        assert stats.retired and stats.draining


async def test_a_bad_drain_timeout_is_refused():
    async with cluster(FakeEngineClient(SEQ), [FakeEngineClient(SEQ)]) as (p1, _, _):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _retire(p1, float("nan"))
        assert error_detail(ei.value).http_status == 400
        assert not p1.server.controller.retired


async def test_shutdown_moves_what_outlasts_its_drain_to_a_peer():
    local = FakeEngineClient(SEQ, delay=0.03)
    peer = FakeEngineClient(SEQ)
    async with cluster(local, [peer], drain_timeout=0.1) as (p1, _, _):
        running = asyncio.create_task(
            p1.chat_stream({"messages": MSG, "max_tokens": 60, "stream": True})
        )
        await wait_for(lambda: local.tokens_sent >= 3)
        _align(peer, p1)
        await p1.server.shutdown()
        out = await running
        assert streamed_text(out) == p1.tok.decode(SEQ[:-1])
        (rec,) = p1.records
        assert rec.replicas[1][1] == "p2" and rec.token_ids == SEQ


async def test_a_single_proxy_retires_too():
    """No peer at all: the drain still lets the engine finish; only what outlasts it fails."""
    local = FakeEngineClient(SEQ, delay=0.01)
    h = await start(local, proxy_id="solo")
    try:
        running = asyncio.create_task(h.chat({"messages": MSG, "max_tokens": 60}))
        await wait_for(lambda: local.tokens_sent >= 2)
        done = await _retire(h, 5.0)
        assert (done.finished, done.moved) == (1, 0)
        assert (await running)["choices"][0]["finish_reason"] == "stop"
    finally:
        await h.close()


async def test_health_follows_the_engine_and_a_retirement_is_announced():
    """The router watches grpc.health: an engine failure shows as NOT_SERVING at once, and a
    retirement as a NOT_SERVING blip (the router then polls and reads `draining`), after
    which the retired proxy is SERVING for the sessions pinned to it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    local = FakeEngineClient(SEQ)
    async with cluster(local, [FakeEngineClient(SEQ)]) as (p1, _, _):
        health = health_pb2_grpc.HealthStub(p1.channel)
        seen: list[int] = []

        async def watch() -> None:
            async for r in health.Watch(health_pb2.HealthCheckRequest(service="")):
                seen.append(r.status)

        watcher = asyncio.create_task(watch())
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        await wait_for(lambda: seen == [serving])
        local.healthy = False
        await p1.server._check_engine()
        await wait_for(lambda: seen == [serving, not_serving])
        local.healthy = True
        await p1.server._check_engine()
        await wait_for(lambda: seen == [serving, not_serving, serving])
        await _retire(p1, 0.0)
        await wait_for(lambda: seen[3:] == [not_serving, serving])
        # Retired: its engine's health no longer matters.
        local.healthy = False
        await p1.server._check_engine()
        await asyncio.sleep(0.1)
        assert seen[-1] == serving
        watcher.cancel()
