"""`Generate`: many requests over one stream, with the semantics of the per-call RPCs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, request, start, wait_for

from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.engine.base import EngineError
from areal_proxy.serving.multiplex import COALESCE_S, QUEUE_LIMIT

MSG = [{"role": "user", "content": "hi"}]
SEQ = [*range(40, 60), EOS]
CHAT = proxy_pb2.GENERATE_KIND_CHAT
COMPLETION = proxy_pb2.GENERATE_KIND_COMPLETION


def frame(rid: int, kind: int, body: dict[str, Any], *, stream: bool = False, **kw: Any) -> Any:
    req = request(body, **kw)
    req.envelope.stream = stream
    return proxy_pb2.GenerateFrame(id=rid, kind=kind, request=req)  # type: ignore[arg-type]


class Mux:
    """The caller's end of one Generate stream, collecting results per request id."""

    def __init__(self, stub: Any, metadata: Any = ()) -> None:
        self.call = stub.Generate(metadata=metadata)
        self.results: dict[int, list[Any]] = {}
        self.messages = 0
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.call:
            self.messages += 1
            for r in msg.results:
                self.results.setdefault(r.id, []).append(r)

    async def send(self, *frames: Any) -> None:
        await self.call.write(proxy_pb2.GenerateFrames(frames=frames))

    def done(self, rid: int) -> bool:
        return any(r.done for r in self.results.get(rid, []))

    async def wait(self, *rids: int, within: float = 5.0) -> None:
        await wait_for(lambda: all(self.done(r) for r in rids), within)

    def chunks(self, rid: int) -> list[dict[str, Any]]:
        return [orjson.loads(r.data) for r in self.results[rid] if r.data]


async def test_many_requests_on_one_stream_match_the_per_call_rpcs():
    engine = FakeEngineClient(SEQ)
    h = await start(engine)
    try:
        body = {"messages": MSG, "logprobs": True}
        whole = await h.chat(body)
        streamed = await h.chat_stream(body)
        completion = await h.completion({"prompt": [5, 6, 7], "max_tokens": 8})
        mux = Mux(h.stub)
        await mux.call.initial_metadata()  # sent as soon as the stream is open
        frames = []
        for i in range(0, 30, 3):
            frames += [
                frame(i + 1, CHAT, body),
                frame(i + 2, CHAT, body, stream=True),
                frame(i + 3, COMPLETION, {"prompt": [5, 6, 7], "max_tokens": 8}),
            ]
        await mux.send(*frames)
        await mux.wait(*range(1, 31))
        for i in range(0, 30, 3):
            (one,) = mux.results[i + 1]
            got = orjson.loads(one.data)
            assert got["choices"] == whole["choices"] and got["usage"] == whole["usage"]
            chunks = mux.chunks(i + 2)
            assert [c["choices"] for c in chunks] == [c["choices"] for c in streamed]
            assert mux.results[i + 2][-1].done and not mux.results[i + 2][-1].data
            (one,) = mux.results[i + 3]
            assert orjson.loads(one.data)["choices"] == completion["choices"]
        # 30 requests, ~10 stream chunks each for a third of them: frames were batched.
        total = sum(len(v) for v in mux.results.values())
        assert mux.messages < total
        mux.call.cancel()
    finally:
        await h.close()


async def test_errors_are_frames_and_the_stream_keeps_serving():
    engine = FakeEngineClient([5, EOS], fail=EngineError("engine down", status=503))
    h = await start(engine)
    try:
        mux = Mux(h.stub)
        await mux.send(
            frame(1, CHAT, {"messages": "not a list"}),
            frame(2, CHAT, {"messages": MSG}),
            frame(3, proxy_pb2.GENERATE_KIND_UNSPECIFIED, {"messages": MSG}),
        )
        await mux.wait(1, 2, 3)
        assert mux.results[1][-1].error.http_status == 400
        assert mux.results[2][-1].error.http_status == 503
        assert mux.results[2][-1].error.code == "engine_unavailable"
        assert mux.results[3][-1].error.http_status == 400
        engine.fail = None
        await mux.send(frame(4, CHAT, {"messages": MSG}))
        await mux.wait(4)
        assert orjson.loads(mux.results[4][0].data)["choices"][0]["finish_reason"] == "stop"
        mux.call.cancel()
    finally:
        await h.close()


async def test_cancel_frame_aborts_only_that_request():
    engine = FakeEngineClient(SEQ * 10, delay=0.02)
    h = await start(engine)
    try:
        mux = Mux(h.stub)
        await mux.send(
            frame(1, CHAT, {"messages": MSG}, stream=True),
            frame(2, CHAT, {"messages": MSG, "max_tokens": 5}, stream=True),
        )
        await wait_for(lambda: len(mux.results.get(1, [])) >= 3)
        await mux.send(proxy_pb2.GenerateFrame(id=1, cancel=True))
        await wait_for(lambda: engine.aborted)
        await mux.wait(2)
        assert not mux.done(1)  # nothing more is sent for a cancelled id
        assert engine.aborted == [engine.requests[0].rid]
        assert mux.chunks(2)[-1]["choices"][0]["finish_reason"] == "length"
        await wait_for(lambda: h.server.servicer.active == 0)
        mux.call.cancel()
    finally:
        await h.close()


async def test_caller_gone_aborts_every_request_on_the_stream():
    engine = FakeEngineClient(SEQ * 10, delay=0.02)
    h = await start(engine)
    try:
        mux = Mux(h.stub)
        await mux.send(*(frame(i, CHAT, {"messages": MSG}, stream=True) for i in (1, 2)))
        await wait_for(lambda: len(engine.requests) == 2 and engine.tokens_sent >= 4)
        mux.call.cancel()
        await wait_for(lambda: len(engine.aborted) == 2)
        await wait_for(lambda: h.server.servicer.active == 0)
    finally:
        await h.close()


async def test_envelope_deadline_is_kept():
    engine = FakeEngineClient(SEQ * 10, delay=0.05)
    h = await start(engine)
    try:
        mux = Mux(h.stub)
        soon = int((time.time() + 0.3) * 1000)
        await mux.send(frame(1, CHAT, {"messages": MSG}, deadline_ms=soon))
        await mux.wait(1)
        assert mux.results[1][-1].error.http_status == 504
        assert engine.aborted
        mux.call.cancel()
    finally:
        await h.close()


async def test_drain_ends_streams_after_their_requests():
    engine = FakeEngineClient(SEQ, delay=0.02)
    h = await start(engine)
    mux = Mux(h.stub)
    await mux.send(frame(1, CHAT, {"messages": MSG}, stream=True))
    await wait_for(lambda: engine.tokens_sent >= 2)
    t0 = time.monotonic()
    shutdown = asyncio.create_task(h.server.shutdown())
    await wait_for(lambda: h.server.state.draining)
    await mux.send(frame(2, CHAT, {"messages": MSG}))
    # The running request finishes; the new one is refused as the per-call RPCs refuse it.
    await mux.wait(1, 2)
    assert mux.chunks(1)[-1]["choices"][0]["finish_reason"] == "stop"
    assert mux.results[2][-1].error.code == "draining"
    # The stream then ends cleanly, without holding the server's stop grace period.
    await asyncio.wait_for(mux.reader, 5)
    assert await mux.call.code() == grpc.StatusCode.OK
    await asyncio.wait_for(shutdown, 5)
    assert time.monotonic() - t0 < 1.5
    await h.channel.close()


async def test_generate_needs_the_internal_token(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AREAL_INTERNAL_TOKEN", "s3cret-token-value")
    h = await start(FakeEngineClient([5, EOS]))
    try:
        call = h.stub.Generate()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await asyncio.wait_for(call.read(), 5)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        mux = Mux(h.stub, metadata=(("x-areal-internal-token", "s3cret-token-value"),))
        await mux.send(frame(1, CHAT, {"messages": MSG}))
        await mux.wait(1)
        assert orjson.loads(mux.results[1][0].data)["choices"][0]["finish_reason"] == "stop"
        mux.call.cancel()
    finally:
        await h.close()


async def test_a_slow_reader_holds_back_only_its_own_request():
    # One Generate stream, two streamed requests with a window of 4 results each. The caller
    # returns credit for request 2 as its results arrive and never for request 1 (its client
    # stopped reading): request 2 runs to the end, request 1 stops after its window, and the
    # proxy stops reading request 1's engine stream once its queue is full.
    engine = FakeEngineClient([])
    h = await start(engine)
    # Tokens of plain ASCII words: each one's text is whole, so each makes one result.
    engine.sequence = h.tok.encode("the cat sat on a mat " * 60)
    n = len(engine.sequence)
    try:
        mux = Mux(h.stub)
        body = {"prompt": [5, 6, 7], "max_tokens": n}
        slow = frame(1, COMPLETION, body, stream=True)
        slow.window = 4
        fast = frame(2, COMPLETION, body, stream=True)
        fast.window = 4
        credited = 0

        async def credit_fast() -> None:
            nonlocal credited
            while not mux.done(2):
                got = len(mux.results.get(2, []))
                if got > credited:
                    await mux.send(proxy_pb2.GenerateFrame(id=2, credit=got - credited))
                    credited = got
                await asyncio.sleep(0.001)

        await mux.send(slow, fast)
        await asyncio.wait_for(credit_fast(), 10)
        assert len(mux.chunks(2)) == n
        assert mux.chunks(2)[-1]["choices"][0]["finish_reason"] == "length"
        (stream,) = h.server.servicer._streams
        await asyncio.sleep(0.2)  # whatever request 1 could still do, it has done
        assert len(mux.results[1]) == 4 and not mux.done(1)
        assert stream.backlog() <= QUEUE_LIMIT
        # The metrics say so: request 1's full queue is held (request 2's gave credit), and
        # its task waited for room.
        assert held(h) == QUEUE_LIMIT
        assert credit_waits(h) >= 1  # (its queue was full: the next chunk made it wait)
        # Request 1's engine tokens: its 4 sent results, its full queue, and the one its
        # task holds while it waits for room; the engine has the rest still to produce.
        assert engine.tokens_sent - n <= 4 + QUEUE_LIMIT + 2
        # Its client reads again: the request resumes and completes, nothing lost.
        await mux.send(proxy_pb2.GenerateFrame(id=1, credit=10 * n))
        await mux.wait(1)
        assert "".join(c["choices"][0]["text"] for c in mux.chunks(1)) == "".join(
            c["choices"][0]["text"] for c in mux.chunks(2)
        )
        assert held(h) == 0
        mux.call.cancel()
    finally:
        await h.close()


def held(h: Any) -> float:
    return h.server.metrics.registry.get_sample_value("areal_proxy_stream_held_results")


def credit_waits(h: Any) -> float:
    return h.server.metrics.registry.get_sample_value("areal_proxy_stream_credit_waits_total")


async def test_held_results_and_credit_waits_count_every_stream():
    # Two Generate streams (two gateways), each with one streamed request whose caller
    # gives a window of 2 and then no credit: each holds a full queue, and the gauge is
    # their sum. Credit moves results out (the task refills its queue and waits again); a
    # cancelled request and a stream that went away hold nothing.
    engine = FakeEngineClient([])
    h = await start(engine)
    engine.sequence = h.tok.encode("the cat sat on a mat " * 60)
    body = {"prompt": [5, 6, 7], "max_tokens": len(engine.sequence)}
    try:
        assert held(h) == 0 and credit_waits(h) == 0
        a, b = Mux(h.stub), Mux(h.stub)
        for mux in (a, b):
            f = frame(1, COMPLETION, body, stream=True)
            f.window = 2
            await mux.send(f)
        # Each task waited at least once (more if it filled its queue before the writer
        # had sent the first two results).
        await wait_for(lambda: held(h) == 2 * QUEUE_LIMIT and credit_waits(h) >= 2, 5)
        assert [len(m.results[1]) for m in (a, b)] == [2, 2]
        waits = credit_waits(h)
        await a.send(proxy_pb2.GenerateFrame(id=1, credit=5))
        # Its queue refilled and is full again: its task waited again.
        await wait_for(
            lambda: (
                len(a.results[1]) == 7 and held(h) == 2 * QUEUE_LIMIT and credit_waits(h) > waits
            ),
            5,
        )
        await a.send(proxy_pb2.GenerateFrame(id=1, cancel=True))
        await wait_for(lambda: held(h) == QUEUE_LIMIT, 5)
        b.call.cancel()
        await wait_for(lambda: held(h) == 0, 5)
        a.call.cancel()
    finally:
        await h.close()


async def test_streams_tokens_share_messages_while_they_keep_coming():
    # 40 streamed chats, started 0.3 ms apart, each yielding a token every 5 ms: the writer
    # sends at most one message per COALESCE_S while results keep coming, each carrying
    # many requests' tokens, rather than one whenever the previous write is done.
    engine = FakeEngineClient(SEQ, delay=0.005)
    h = await start(engine)
    try:
        mux = Mux(h.stub)
        await mux.call.initial_metadata()
        body = {"messages": MSG}
        t0 = time.monotonic()
        for i in range(1, 41):
            await mux.send(frame(i, CHAT, body, stream=True))
            await asyncio.sleep(0.0003)
        await mux.wait(*range(1, 41), within=10)
        elapsed = time.monotonic() - t0
        results = sum(len(r) for r in mux.results.values())
        assert all(mux.chunks(i)[-1]["choices"][0]["finish_reason"] for i in range(1, 41))
        assert results >= 40 * len(SEQ)
        # At most one message per window (plus the first of each quiet spell), whatever the
        # number of tokens: ~60 messages for 880 results here, ~150 without the window.
        assert mux.messages <= elapsed / COALESCE_S + 10, (mux.messages, results, elapsed)
        assert mux.messages * 10 < results, (mux.messages, results)
    finally:
        await h.close()
