"""The gateway's end of the multiplexed `Generate` stream against proxies that misbehave.

The real proxy's end is tested in areal-proxy (test_proxy_multiplex.py) and end to end in
tests/e2e; here the proxy is a scripted servicer so each way a stream can end is exact.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from areal_gateway.clients import ProxyPool, ProxyUnreachable, generation_request
from areal_gateway.clients.proxy import SHARED_STREAM_MAX_BODY, WINDOW
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_runtime.errors import ServiceError


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
        self.tasks: list[asyncio.Future[None]] = []

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
                if self.mode == "trickle":  # a chunk every 30 ms, never done
                    self.tasks.append(asyncio.ensure_future(self._trickle(f.id, context)))
                # "hang": never answer

    async def _trickle(self, rid: int, context: Any) -> None:
        while rid not in self.cancelled:
            result = proxy_pb2.GenerateResult(id=rid, data=b'{"n":1}')
            try:
                await context.write(proxy_pb2.GenerateResults(results=[result]))
            except Exception:
                return
            await asyncio.sleep(0.03)


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


async def test_a_stream_that_keeps_coming_still_ends_at_its_deadline(pool: ProxyPool):
    # The deadline is the request's (one timer for the whole stream), not a wait's: chunks
    # arriving every 30 ms do not push it back.
    fake = Scripted("trickle")
    server, address = await _serve(fake)
    try:
        got = 0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ServiceError) as ei:
            async for batch in pool.get(address).chat_completion_stream(_request(True), 0.3):
                got += len(batch)
        assert ei.value.http_status == 504
        assert got >= 3
        assert 0.3 <= loop.time() - t0 < 1.5
        for _ in range(100):
            if fake.cancelled:
                break
            await asyncio.sleep(0.02)
        assert fake.cancelled == [1]  # the proxy is told to stop it
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
    """Generate as `Scripted("ok")`, and the per-call RPCs, recording the body sizes each got."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.call_bodies: list[int] = []

        self.envelopes: list[envelope_pb2.Envelope] = []

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        self.call_bodies.append(request.body)
        self.envelopes.append(request.envelope)
        return envelope_pb2.OpenAIResponse(body=b'{"unary":true}')

    async def ChatCompletionStream(self, request: Any, context: Any) -> Any:
        self.call_bodies.append(request.body)
        self.envelopes.append(request.envelope)
        yield envelope_pb2.StreamChunk(data=b'{"unary":1}')


async def test_a_big_body_takes_a_call_of_its_own_not_the_shared_stream(pool: ProxyPool):
    # A frame of megabytes on the shared stream would hold every small request behind it.
    fake = Both()
    server, address = await _serve(fake)
    try:
        client = pool.get(address)
        body = b'{"x":"%s"}' % (b"y" * SHARED_STREAM_MAX_BODY)
        envelope = envelope_pb2.Envelope(request_id="big", model="m", session_id="s")
        streamed = envelope_pb2.Envelope(request_id="big2", model="m", stream=True)
        big = generation_request(envelope, body)
        assert isinstance(big, bytes)  # encoded by the gateway, sent as it is
        small = await client.chat_completion(generation_request(envelope, b"{}"), 5)
        assert await client.chat_completion(big, 5) == b'{"unary":true}'
        big_stream = generation_request(streamed, body)
        chunks = [c async for b in client.chat_completion_stream(big_stream, 5) for c in b]
        assert chunks == [b'{"unary":1}']
        assert small == b'{"whole":true}'
        assert fake.call_bodies == [body, body]  # the proxy reads the same message
        assert fake.envelopes == [envelope, streamed]
        assert fake.streams == 1  # the small request's
    finally:
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
    body = b"b" * (SHARED_STREAM_MAX_BODY + 1 + extra)
    encoded = generation_request(envelope, body)
    assert isinstance(encoded, bytes)
    message = envelope_pb2.OpenAIRequest(envelope=envelope, body=body)
    assert encoded == message.SerializeToString()
    assert envelope_pb2.OpenAIRequest.FromString(encoded) == message
    # At the threshold the body still goes on the shared stream, as a message.
    small = generation_request(envelope, body[:SHARED_STREAM_MAX_BODY])
    assert small == envelope_pb2.OpenAIRequest(
        envelope=envelope, body=body[:SHARED_STREAM_MAX_BODY]
    )


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
