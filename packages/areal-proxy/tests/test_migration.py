"""Migration: a request whose engine dies continues on another replica's engine,
through that replica's proxy (ContinueGeneration). Real ProxyServers on loopback, a fake
router answering ListProxies, fake engines that die after k tokens."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import orjson
import pytest
from peer_fakes import cluster
from peer_fakes import count as _count
from peer_fakes import streamed_text as _text
from proxy_fakes import (
    EOS,
    FakeEngineClient,
    error_detail,
    lp_of,
    request,
    wait_for,
)

from areal_proto.proxy.v1 import proxy_pb2
from areal_proto.router.v1 import router_pb2
from areal_proxy.engine.base import EngineError, GenerationChunk, GenerationRequest
from areal_proxy.engine.peer import request_from, sampling_json
from areal_proxy.settings import load_settings
from areal_runtime.auth import TOKEN_ENV
from areal_runtime.errors import InvalidRequest

MSG = [{"role": "user", "content": "hi"}]
SEQ = [*range(40, 60), EOS]  # 21 tokens, ends with the end-of-turn token
HEALTHY = router_pb2.PROXY_HEALTH_HEALTHY


class DyingEngine(FakeEngineClient):
    """Produces the first `k` tokens of its sequence, then dies under the request: `how` is
    "error" (the connection breaks: EngineError lost) or "close" (the stream just ends). A whole
    (non-streamed) call dies with nothing."""

    def __init__(self, sequence: list[int], k: int, how: str = "error", **kw: Any) -> None:
        super().__init__(sequence, **kw)
        self.k = k
        self.how = how

    async def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(req)
        for token in self.sequence[: self.k]:
            if self.delay:
                await asyncio.sleep(self.delay)
            self.tokens_sent += 1
            yield self._chunk([token], req, None)
        if self.how == "error":
            raise EngineError("engine connection lost (test)", status=503, lost=True)

    async def generate(self, req: GenerationRequest) -> Any:
        self.requests.append(req)
        raise EngineError("engine connection lost (test)", status=503, lost=True)


@pytest.mark.parametrize("how", ["error", "close"])
async def test_a_stream_continues_on_a_peer_with_exactly_the_remaining_tokens(how):
    k = 5
    peer_engine = FakeEngineClient(SEQ[k:])
    async with cluster(DyingEngine(SEQ, k, how), [peer_engine]) as (p1, (p2,), router):
        await p2.stub.SetVersion(proxy_pb2.SetVersionRequest(version=7))
        body = {
            "messages": MSG,
            "max_tokens": 50,
            "temperature": 0.5,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
        }
        out = await p1.chat_stream(body)

        first = p1.engine.requests[0]
        (cont,) = peer_engine.requests
        assert cont.input_ids == first.input_ids + SEQ[:k]
        assert cont.max_new_tokens == 50 - k
        assert cont.temperature == 0.5 and cont.top_logprobs == 2
        assert cont.stop_token_ids == first.stop_token_ids
        assert _text(out) == p1.tok.decode(SEQ[:-1])
        assert out[-1]["choices"][0]["finish_reason"] == "stop"
        lps = [
            e
            for c in out
            if c["choices"]
            for e in (c["choices"][0].get("logprobs") or {}).get("content") or []
        ]
        assert [e["logprob"] for e in lps] == [lp_of(t) for t in SEQ]
        assert all(len(e["top_logprobs"]) == 2 for e in lps)

        rec = next(r for r in p1.records if r.prompt_ids == first.input_ids)
        assert rec.token_ids == SEQ and rec.finish_reason == "stop"
        assert rec.replicas == [(0, ""), (k, "p2")]
        assert rec.versions == [0] * k + [7] * (len(SEQ) - k)
        assert rec.logprobs == [lp_of(t) for t in SEQ]
        assert rec.migrations == 1
        assert router.asked == [("tiny-parrot", router_pb2.PROXY_KIND_INFERENCE)]
        assert _count(p1, "continued") == 1


async def test_a_whole_answer_arrives_whole():
    peer_engine = FakeEngineClient(SEQ)
    async with cluster(DyingEngine(SEQ, 0), [peer_engine]) as (p1, _, _):
        out = await p1.chat({"messages": MSG, "max_tokens": 50, "logprobs": True})

        (first,) = p1.engine.requests
        (cont,) = peer_engine.requests
        # The whole call that died left nothing: the peer starts from the prompt.
        assert cont.input_ids == first.input_ids and cont.max_new_tokens == 50
        assert out["choices"][0]["message"]["content"] == p1.tok.decode(SEQ[:-1])
        assert out["choices"][0]["finish_reason"] == "stop"
        rec = p1.records[0]
        assert rec.token_ids == SEQ and rec.replicas == [(0, "p2")]


async def test_a_chain_of_dying_peers_stops_at_the_limit():
    engines = [DyingEngine(SEQ, 0), DyingEngine(SEQ, 2), DyingEngine(SEQ[2:], 2)]
    spare = FakeEngineClient(SEQ[4:])
    async with cluster(engines[0], [engines[1], engines[2], spare], migration_limit=2) as (
        p1,
        _,
        _,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await p1.chat({"messages": MSG, "max_tokens": 50})
        d = error_detail(ei.value)
        assert d.http_status == 503 and d.code == "migration_failed"
        assert d.message.startswith("migration") and "--migration-limit 2" in d.message
        prompt = engines[0].requests[0].input_ids
        # p2 made 2 tokens before it died; p3 continued after them, made 2, died: the limit.
        assert engines[1].requests[0].input_ids == prompt
        assert engines[2].requests[0].input_ids == prompt + SEQ[:2]
        assert engines[2].requests[0].max_new_tokens == 48
        assert spare.requests == []
        assert _count(p1, "continued") == 2
        assert _count(p1, "peer_failed") == 2
        assert _count(p1, "refused_limit") == 1
        rec = p1.records[0]
        assert rec.token_ids == SEQ[:4] and rec.replicas == [(0, "p2"), (2, "p3")]


async def test_migration_limit_zero_never_migrates():
    peer_engine = FakeEngineClient(SEQ)
    async with cluster(DyingEngine(SEQ, 3), [peer_engine], migration_limit=0) as (p1, _, _):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await p1.chat({"messages": MSG, "max_tokens": 50, "stream": True})
        d = error_detail(ei.value)
        assert d.code == "migration_failed" and "--migration-limit 0" in d.message
        assert peer_engine.requests == []
        assert _count(p1, "refused_limit") == 1


@pytest.mark.parametrize("k", [3, 0])
async def test_a_constrained_generation_moves_only_without_output(k):
    peer_engine = FakeEngineClient(SEQ)
    async with cluster(DyingEngine(SEQ, k), [peer_engine]) as (p1, _, _):
        body = {
            "messages": MSG,
            "max_tokens": 50,
            "response_format": {"type": "regex", "regex": "[0-9]+"},
            "stream": True,
        }
        if k:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await p1.chat_stream(body)
            d = error_detail(ei.value)
            assert d.http_status == 503 and d.code == "migration_failed"
            assert d.message.startswith("migration") and "constrained" in d.message
            assert peer_engine.requests == []
            assert _count(p1, "refused_constraint") == 1
        else:
            out = await p1.chat_stream(body)
            assert _text(out) == p1.tok.decode(SEQ[:-1])
            (cont,) = peer_engine.requests
            assert cont.input_ids == p1.engine.requests[0].input_ids
            assert cont.constraint == ("regex", "[0-9]+")


async def test_several_choices_are_not_migrated():
    peer_engine = FakeEngineClient(SEQ)
    async with cluster(DyingEngine(SEQ, 2), [peer_engine]) as (p1, _, _):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await p1.chat({"messages": MSG, "max_tokens": 50, "n": 2})
        d = error_detail(ei.value)
        assert d.code == "migration_failed" and "n > 1" in d.message
        assert peer_engine.requests == []
        assert _count(p1, "refused_n") >= 1


async def test_without_a_router_or_a_peer_the_request_fails_saying_why():
    peer_engine = FakeEngineClient(SEQ)
    async with cluster(DyingEngine(SEQ, 2), [peer_engine], router=False) as (p1, _, _):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await p1.chat({"messages": MSG, "max_tokens": 50})
        d = error_detail(ei.value)
        assert d.code == "migration_failed" and "--router-addr" in d.message
    async with cluster(DyingEngine(SEQ, 2), [peer_engine]) as (p1, _, router):
        # The only other replica is unhealthy: nobody to go to.
        router.proxies[1].health = router_pb2.PROXY_HEALTH_UNHEALTHY
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await p1.chat({"messages": MSG, "max_tokens": 50})
        d = error_detail(ei.value)
        assert d.code == "migration_failed" and "no other healthy replica" in d.message
        assert peer_engine.requests == []
        assert _count(p1, "no_peer") == 1


async def test_an_engine_refusal_is_not_migrated():
    first = FakeEngineClient(
        SEQ, fail=EngineError("engine rejected the request: too long", status=400)
    )
    peer_engine = FakeEngineClient(SEQ)
    async with cluster(first, [peer_engine]) as (p1, _, router):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await p1.chat({"messages": MSG, "max_tokens": 50, "stream": True})
        assert error_detail(ei.value).http_status == 400
        assert peer_engine.requests == [] and router.asked == []
        assert all(_count(p1, o) == 0 for o in ("continued", "no_peer", "refused_limit"))


async def test_a_draining_peer_is_skipped():
    after = FakeEngineClient(SEQ[2:])
    draining = FakeEngineClient(SEQ[2:])
    async with cluster(DyingEngine(SEQ, 2), [draining, after]) as (p1, (p2, _p3), _):
        p2.server.state.draining = True
        out = await p1.chat_stream({"messages": MSG, "max_tokens": 50, "stream": True})
        assert _text(out) == p1.tok.decode(SEQ[:-1])
        assert draining.requests == [] and len(after.requests) == 1
        assert p1.records[0].replicas == [(0, ""), (2, "p3")]
        assert _count(p1, "peer_failed") == 1 and _count(p1, "continued") == 2


async def test_the_client_going_away_aborts_the_peers_engine_request():
    peer_engine = FakeEngineClient(SEQ[2:], delay=0.05)
    async with cluster(DyingEngine(SEQ, 2), [peer_engine]) as (p1, (p2,), _):
        body = {"messages": MSG, "max_tokens": 50, "stream": True}
        task = asyncio.create_task(p1.chat_stream(body))
        await wait_for(lambda: peer_engine.tokens_sent >= 2)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        (cont,) = peer_engine.requests
        await wait_for(lambda: cont.rid in peer_engine.aborted)
        await wait_for(lambda: not p2.server.controller.inflight)
        assert peer_engine.tokens_sent < len(SEQ) - 2


async def test_the_internal_token_travels_to_the_peer(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    k = 3
    peer_engine = FakeEngineClient(SEQ[k:])
    async with cluster(DyingEngine(SEQ, k), [peer_engine]) as (p1, _, _):
        # The test's own channel carries no token: P1 is called with it here.
        md = (("x-areal-internal-token", "s3cret"),)
        call = p1.stub.ChatCompletionStream(
            request({"messages": MSG, "max_tokens": 50, "stream": True}), metadata=md
        )
        out = [orjson.loads(c.data) async for c in call]
        assert _text(out) == p1.tok.decode(SEQ[:-1])
        assert len(peer_engine.requests) == 1


def test_the_sampling_travels_whole_and_unknown_fields_are_refused():
    req = GenerationRequest(
        input_ids=[1, 2],
        max_new_tokens=9,
        temperature=0.3,
        top_k=5,
        stop_token_ids=[2, 7],
        seed=11,
        top_logprobs=3,
        constraint=("json_schema", '{"type": "object"}'),
        extra={"custom_logit_processor": "x"},
    )
    msg = proxy_pb2.ContinueGenerationRequest(
        input_ids=[1, 2, 40], max_new_tokens=8, sampling=sampling_json(req), top_logprobs=3
    )
    back = request_from(msg)
    assert back == replace(req, input_ids=[1, 2, 40], max_new_tokens=8)
    bad = orjson.loads(msg.sampling) | {"temperatur": 1.0}
    msg.sampling = orjson.dumps(bad)
    with pytest.raises(InvalidRequest, match="temperatur"):
        request_from(msg)


def test_the_migration_flags():
    base = ["--engine-url", "http://127.0.0.1:1", "--model", "m", "--tokenizer-path", "x"]
    s = load_settings(base)
    assert (s.router_addr, s.migration_limit) == ("", 3) and s.problems() == []
    s = load_settings([*base, "--router-addr", "10.0.0.1:7000", "--migration-limit", "0"])
    assert (s.router_addr, s.migration_limit) == ("10.0.0.1:7000", 0) and s.problems() == []
    s = load_settings([*base, "--router-addr", "router", "--migration-limit", "-1"])
    assert s.problems() == ["--migration-limit must be >= 0", "--router-addr must be host:port"]


async def test_requests_on_a_generate_stream_migrate_too():
    from test_proxy_multiplex import CHAT, Mux, frame

    k = 4
    peer_engine = FakeEngineClient(SEQ[k:])
    async with cluster(DyingEngine(SEQ, k), [peer_engine]) as (p1, _, _):
        mux = Mux(p1.stub)
        body = {"messages": MSG, "max_tokens": 50}
        deadline = int((time.time() + 30) * 1000)
        await mux.send(frame(1, CHAT, body, stream=True, deadline_ms=deadline))
        await mux.wait(1)
        assert not mux.results[1][-1].HasField("error")
        assert _text(mux.chunks(1)) == p1.tok.decode(SEQ[:-1])
        (cont,) = peer_engine.requests
        assert cont.input_ids == p1.engine.requests[0].input_ids + SEQ[:k]
        mux.call.cancel()
