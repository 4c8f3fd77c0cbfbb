"""The gateway's end of the multiplexed `Generate` stream against proxies that misbehave.

The real proxy's end is tested in areal-proxy (test_proxy_multiplex.py) and end to end in
tests/e2e; here the proxy is a scripted servicer so each way a stream can end is exact.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_gateway.clients import (
    GenerateStream,
    LargeRequest,
    ProxyPool,
    ProxyUnreachable,
    generation_request,
)
from areal_gateway.clients.proxy import PART_BYTES, WINDOW, _repart
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_runtime.errors import ServiceError

CHAT = proxy_pb2.GENERATE_KIND_CHAT


def _request(stream: bool = False) -> envelope_pb2.OpenAIRequest:
    return envelope_pb2.OpenAIRequest(
        envelope=envelope_pb2.Envelope(request_id="r", model="m", stream=stream), body=b"{}"
    )


class Scripted(proxy_pb2_grpc.InferenceProxyServiceServicer):
    """Answers each Generate request per `mode`; counts the streams opened."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.streams = 0
        self.cancelled: list[int] = []
        self.unary_calls = 0

    async def Generate(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        self.streams += 1
        await context.send_initial_metadata(())
        async for msg in request_iterator:
            for f in msg.frames:
                if f.cancel:
                    self.cancelled.append(f.id)
                    continue
                if self.mode == "close":  # read, never answer, end cleanly
                    return
                if self.mode == "die":  # one chunk, then the transport fails
                    await context.write(
                        proxy_pb2.GenerateResults(
                            results=[proxy_pb2.GenerateResult(id=f.id, data=b'{"n":1}')]
                        )
                    )
                    await asyncio.sleep(0.05)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "proxy died")
                if self.mode == "ok":
                    done = proxy_pb2.GenerateResult(id=f.id, done=True)
                    chunks = [
                        proxy_pb2.GenerateResult(id=f.id, data=b'{"n":%d}' % i) for i in (1, 2)
                    ]
                    if f.request.envelope.stream:
                        await context.write(proxy_pb2.GenerateResults(results=[*chunks, done]))
                    else:
                        done.data = b'{"whole":true}'
                        await context.write(proxy_pb2.GenerateResults(results=[done]))
                # "hang": never answer


class NoGenerate(proxy_pb2_grpc.InferenceProxyServiceServicer):
    """Breaks the contract: the per-call RPCs only, Generate left UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.unary_calls = 0

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        self.unary_calls += 1
        return envelope_pb2.OpenAIResponse(body=b'{"unary":true}')


async def _serve(servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    proxy_pb2_grpc.add_InferenceProxyServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def pool():
    p = ProxyPool("")
    yield p
    await p.close()


async def test_many_requests_share_one_stream(pool: ProxyPool):
    fake = Scripted("ok")
    server, address = await _serve(fake)
    try:
        client = pool.get(address)
        bodies = await asyncio.gather(*(client.chat_completion(_request(), 5) for _ in range(20)))
        assert bodies == [b'{"whole":true}'] * 20
        batches = [b async for b in client.chat_completion_stream(_request(True), 5)]
        assert [c for b in batches for c in b] == [b'{"n":1}', b'{"n":2}']
        assert fake.streams == 1
    finally:
        await server.stop(0)


async def test_unread_request_is_unreachable_so_it_may_go_elsewhere(pool: ProxyPool):
    server, address = await _serve(Scripted("close"))
    try:
        with pytest.raises(ProxyUnreachable):
            await pool.get(address).chat_completion(_request(), 5)
    finally:
        await server.stop(0)


async def test_stream_dying_mid_request_is_a_502_after_what_arrived(pool: ProxyPool):
    server, address = await _serve(Scripted("die"))
    try:
        got: list[bytes] = []
        with pytest.raises(ServiceError) as ei:
            async for batch in pool.get(address).chat_completion_stream(_request(True), 5):
                got += batch
        assert got == [b'{"n":1}']
        assert ei.value.http_status == 502 and not isinstance(ei.value, ProxyUnreachable)
    finally:
        await server.stop(0)


async def test_deadline_and_disconnect_cancel_on_the_proxy(pool: ProxyPool):
    fake = Scripted("hang")
    server, address = await _serve(fake)
    try:
        client = pool.get(address)
        with pytest.raises(ServiceError) as ei:
            await client.chat_completion(_request(), 0.2)
        assert ei.value.http_status == 504
        task = asyncio.ensure_future(client.chat_completion(_request(), 5))
        await asyncio.sleep(0.2)
        task.cancel()  # the HTTP client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if len(fake.cancelled) == 2:
                break
            await asyncio.sleep(0.02)
        assert fake.cancelled == [1, 2] and fake.streams == 1
    finally:
        await server.stop(0)


async def test_proxy_without_generate_is_an_error_not_a_fallback(pool: ProxyPool):
    # Generate is part of InferenceProxyService and proxy and gateway ship together: the
    # gateway does not quietly fall back to one call per request (only --no-proxy-streams
    # does), and the request never reached a proxy that could run it.
    fake = NoGenerate()
    server, address = await _serve(fake)
    try:
        with pytest.raises(ServiceError) as ei:
            await pool.get(address).chat_completion(_request(), 5)
        assert not isinstance(ei.value, ProxyUnreachable)
        assert fake.unary_calls == 0
    finally:
        await server.stop(0)


async def test_nothing_listening_is_unreachable(pool: ProxyPool):
    server, address = await _serve(Scripted("ok"))
    await server.stop(0)
    with pytest.raises(ProxyUnreachable):
        await pool.get(address).chat_completion(_request(), 5)


async def test_streams_off_means_one_call_per_request():
    fake = Scripted("ok")
    server, address = await _serve(fake)
    pool = ProxyPool("", streams=False)
    try:
        with pytest.raises(ServiceError):  # the scripted proxy has no per-call RPCs
            await pool.get(address).chat_completion(_request(), 5)
        assert fake.streams == 0
    finally:
        await pool.close()
        await server.stop(0)


class Both(Scripted):
    """Generate as `Scripted("ok")` for whole bodies; a body in parts is put together and
    answered with its length and the parts' sizes. The per-call RPCs answer too, recording
    what they got."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.call_bodies: list[bytes] = []
        self.envelopes: list[envelope_pb2.Envelope] = []
        self.assembled: dict[int, bytes] = {}
        # Per message on the stream: its frames as (id, has a request, more, part bytes).
        self.messages: list[list[tuple[int, bool, bool, int]]] = []

    async def Generate(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        self.streams += 1
        await context.send_initial_metadata(())
        held: dict[int, tuple[Any, list[bytes]]] = {}
        async for msg in request_iterator:
            self.messages.append(
                [(f.id, f.HasField("request"), f.more, len(f.part)) for f in msg.frames]
            )
            for f in msg.frames:
                if f.cancel:
                    self.cancelled.append(f.id)
                    held.pop(f.id, None)
                    continue
                if f.HasField("request") and not f.more:
                    body = b'{"whole":true}'
                    self.envelopes.append(f.request.envelope)
                elif f.HasField("request"):
                    held[f.id] = (f.request, [])
                    continue
                elif f.id not in held:
                    continue
                else:
                    held[f.id][1].append(f.part)
                    if f.more:
                        continue
                    req, parts = held.pop(f.id)
                    self.assembled[f.id] = b"".join(parts)
                    self.envelopes.append(req.envelope)
                    body = b'{"parts":%d}' % len(parts)
                done = proxy_pb2.GenerateResult(id=f.id, done=True, data=body)
                await context.write(proxy_pb2.GenerateResults(results=[done]))

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        self.call_bodies.append(request.body)
        self.envelopes.append(request.envelope)
        return envelope_pb2.OpenAIResponse(body=b'{"unary":true}')

    async def ChatCompletionStream(self, request: Any, context: Any) -> Any:
        self.call_bodies.append(request.body)
        self.envelopes.append(request.envelope)
        yield envelope_pb2.StreamChunk(data=b'{"unary":1}')


async def test_a_big_body_goes_on_the_shared_stream_in_parts(pool: ProxyPool):
    # A frame of megabytes on the shared stream would hold every small request behind it,
    # and copying it holds the GIL for milliseconds: it goes a part per message.
    fake = Both()
    server, address = await _serve(fake)
    try:
        client = pool.get(address)
        # Read in pieces of a server's choosing: one tiny, one over a part, the rest.
        body = b'{"x":"%s"}' % (b"y" * (3 * PART_BYTES))
        pieces = [body[:7], body[7 : 7 + PART_BYTES + 5], body[7 + PART_BYTES + 5 :]]
        envelope = envelope_pb2.Envelope(request_id="big", model="m", session_id="s")
        big = generation_request(envelope, pieces)
        assert isinstance(big, LargeRequest)
        small, answer = await asyncio.gather(
            client.chat_completion(generation_request(envelope, b"{}"), 5),
            client.chat_completion(big, 5),
        )
        assert small == b'{"whole":true}' and answer == b'{"parts":4}'
        assert fake.assembled == {2: body}
        assert fake.envelopes[-1] == envelope and fake.call_bodies == []
        assert fake.streams == 1
        # One part per message at most, so no message is much over a part.
        for message in fake.messages:
            assert sum(1 for f in message if f[3]) <= 1
        assert max(f[3] for m in fake.messages for f in m) == PART_BYTES
    finally:
        await server.stop(0)


async def test_streams_off_a_big_body_is_one_encoded_call(pool: ProxyPool):
    fake = Both()
    server, address = await _serve(fake)
    off = ProxyPool("", streams=False)
    try:
        client = off.get(address)
        body = b'{"x":"%s"}' % (b"y" * PART_BYTES)
        envelope = envelope_pb2.Envelope(request_id="big", model="m", session_id="s")
        streamed = envelope_pb2.Envelope(request_id="big2", model="m", stream=True)
        assert await client.chat_completion(generation_request(envelope, body), 5) == (
            b'{"unary":true}'
        )
        big_stream = generation_request(streamed, [body[:10], body[10:]])
        chunks = [c async for b in client.chat_completion_stream(big_stream, 5) for c in b]
        assert chunks == [b'{"unary":1}']
        assert fake.call_bodies == [body, body]  # the proxy reads the same message
        assert fake.envelopes == [envelope, streamed]
        assert fake.streams == 0
    finally:
        await off.close()
        await server.stop(0)


@pytest.mark.parametrize("extra", [0, 1, 127, 128, 16383, 16384, 2**21])
def test_an_encoded_request_is_the_message_its_proxy_parses(extra: int):
    # Every varint length boundary of the body field, and an envelope with all its fields.
    envelope = envelope_pb2.Envelope(
        request_id="r",
        api_key="areal-sk-a.b",
        model="m",
        stream=True,
        deadline_unix_ms=2**40,
        session_id="s",
        is_admin=True,
    )
    body = b"b" * (PART_BYTES + 1 + extra)
    large = generation_request(envelope, body)
    assert isinstance(large, LargeRequest)
    assert b"".join(large.parts) == body
    message = envelope_pb2.OpenAIRequest(envelope=envelope, body=body)
    assert large.encoded() == message.SerializeToString()
    assert envelope_pb2.OpenAIRequest.FromString(large.encoded()) == message
    # At the threshold the body still goes whole, as a message.
    small = generation_request(envelope, [body[:100], body[100:PART_BYTES]])
    assert small == envelope_pb2.OpenAIRequest(envelope=envelope, body=body[:PART_BYTES])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=12), st.integers(1, 1000))
def test_repart_keeps_the_bytes_in_parts_of_the_size(sizes: list[int], size: int):
    chunks = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    parts = _repart(chunks, size)
    assert b"".join(parts) == b"".join(chunks)
    assert all(len(p) == size for p in parts[:-1])
    assert not parts or 0 < len(parts[-1]) <= size


class FakeCall:
    """A `Generate` call whose writes the test lets complete one at a time."""

    def __init__(self) -> None:
        self.written: list[Any] = []
        self.gate = asyncio.Semaphore(0)
        self.results: asyncio.Queue[Any] = asyncio.Queue()

    async def write(self, message: Any) -> None:
        self.written.append(message)
        await self.gate.acquire()

    async def read(self) -> Any:
        return await self.results.get()

    def cancel(self) -> None:
        pass


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _big(n_parts: int) -> LargeRequest:
    body = b"z" * (PART_BYTES * (n_parts - 1) + 1)
    big = generation_request(envelope_pb2.Envelope(request_id="big", model="m"), body)
    assert isinstance(big, LargeRequest) and len(big.parts) == n_parts
    return big


async def test_a_small_request_waits_for_one_part_at_most():
    call = FakeCall()
    stream = GenerateStream(call, "fake")
    try:
        big_id, _ = stream.submit(CHAT, _big(5))
        await _settle()
        (first,) = call.written  # the request frame and the first part
        assert [(f.id, f.more, len(f.part)) for f in first.frames] == [
            (big_id, True, 0),
            (big_id, True, PART_BYTES),
        ]
        assert not first.frames[0].request.body
        small_id, _ = stream.submit(CHAT, _request())
        call.gate.release()
        await _settle()
        second = call.written[1]
        assert [(f.id, len(f.part)) for f in second.frames] == [(small_id, 0), (big_id, PART_BYTES)]
        for _ in range(3):
            call.gate.release()
            await _settle()
        last = call.written[-1].frames
        assert len(call.written) == 5 and len(last) == 1
        assert last[0].id == big_id and not last[0].more and len(last[0].part) == 1
    finally:
        call.gate.release()
        await stream.close()


async def test_a_cancel_mid_parts_sends_no_more_of_them():
    call = FakeCall()
    stream = GenerateStream(call, "fake")
    try:
        big_id, _ = stream.submit(CHAT, _big(5))
        await _settle()
        stream.cancel(big_id)
        call.gate.release()
        await _settle()
        assert len(call.written) == 2
        assert [(f.id, f.cancel, len(f.part)) for f in call.written[1].frames] == [
            (big_id, True, 0)
        ]
        call.gate.release()
        await _settle()
        assert len(call.written) == 2  # nothing more to write
    finally:
        call.gate.release()
        await stream.close()


async def test_an_answer_before_the_last_part_stops_the_parts():
    # The proxy refused the body part-way (over its size limit): the rest stays here.
    call = FakeCall()
    stream = GenerateStream(call, "fake")
    try:
        big_id, waiter = stream.submit(CHAT, _big(5))
        await _settle()
        refused = proxy_pb2.GenerateResult(id=big_id, done=True, error={"http_status": 413})
        call.results.put_nowait(proxy_pb2.GenerateResults(results=[refused]))
        await _settle()
        (result,) = await waiter.take(asyncio.get_running_loop().time() + 1)
        assert result.error.http_status == 413
        call.gate.release()
        await _settle()
        assert len(call.written) == 1
    finally:
        call.gate.release()
        await stream.close()


class Metered(proxy_pb2_grpc.InferenceProxyServiceServicer):
    """Streams `n` results per streamed request, honouring the window and credits as the
    real proxy does (window 0: no limit); records what it sent and the credit it got."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent: dict[int, int] = {}
        self.credit: dict[int, int] = {}
        self.windows: list[int] = []

    async def Generate(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        await context.send_initial_metadata(())
        lock = asyncio.Lock()
        changed = asyncio.Event()
        tasks = []

        async def serve(rid: int, window: int) -> None:
            self.sent[rid] = 0
            while self.sent[rid] < self.n:
                if window and self.sent[rid] >= window + self.credit.get(rid, 0):
                    changed.clear()
                    await changed.wait()
                    continue
                i = self.sent[rid] = self.sent[rid] + 1
                result = proxy_pb2.GenerateResult(id=rid, data=b'{"n":%d}' % i)
                async with lock:
                    await context.write(proxy_pb2.GenerateResults(results=[result]))
                await asyncio.sleep(0)
            async with lock:
                await context.write(
                    proxy_pb2.GenerateResults(results=[proxy_pb2.GenerateResult(id=rid, done=True)])
                )

        async for msg in request_iterator:
            for f in msg.frames:
                if f.credit:
                    self.credit[f.id] = self.credit.get(f.id, 0) + f.credit
                    changed.set()
                elif not f.cancel:
                    self.windows.append(f.window)
                    tasks.append(asyncio.ensure_future(serve(f.id, f.window)))
        for t in tasks:
            t.cancel()


async def test_a_slow_client_holds_back_only_its_own_request(pool: ProxyPool):
    # Two streamed requests on one Generate stream; the first client reads one batch and
    # stops, the second reads everything. The second completes; the gateway holds at most
    # its window of the first one's results, and the proxy was never allowed to send more.
    fake = Metered(400)
    server, address = await _serve(fake)
    try:
        client = pool.get(address)
        slow = client.chat_completion_stream(_request(True), 30)
        first = await slow.__anext__()
        assert first
        fast = [c async for b in client.chat_completion_stream(_request(True), 30) for c in b]
        assert len(fast) == 400
        await asyncio.sleep(0.2)  # whatever the proxy may still send for the slow one
        stream = client._mux
        assert stream is not None
        # Without flow control all 400 results and the end arrive unread: the request is gone.
        assert len(stream._waiters) == 1, "the slow request was buffered to its end unread"
        (rid,) = stream._waiters
        assert len(stream._waiters[rid].results) <= WINDOW
        assert fake.sent[rid] <= WINDOW + fake.credit.get(rid, 0) < 400
        # The slow client reads again: its request resumes and completes.
        rest = [c async for b in slow for c in b]
        assert len(first) + len(rest) == 400
        assert fake.windows == [WINDOW, WINDOW]
        await slow.aclose()
    finally:
        await server.stop(0)
