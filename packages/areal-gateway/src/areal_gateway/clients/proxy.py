"""An inference proxy's RPCs (InferenceProxyService): generation over one multiplexed
`Generate` stream (docs/services.md, "Multiplexed generation"), RL sessions, rewards, export
and control."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import orjson

from areal_gateway.clients.common import (
    ROUTER_TIMEOUT,
    ProxyUnreachable,
    ensure_connected,
    open_channel,
    proxy_error,
    read_messages,
)
from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_runtime import tracing
from areal_runtime.auth import call_metadata
from areal_runtime.batching import take_batch
from areal_runtime.errors import (
    InternalAuthFailed,
    ServiceError,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
)

log = logging.getLogger(__name__)

_CHAT = proxy_pb2.GENERATE_KIND_CHAT
_COMPLETION = proxy_pb2.GENERATE_KIND_COMPLETION

# The gateway waits this much past a request's deadline for the proxy's own 504, which
# says more than a transport timeout.
_DEADLINE_GRACE_S = 0.05

# Results of one request the gateway buffers (each request's `window` on the stream): the
# proxy sends no more until credit comes back, so a client that reads slowly holds back only
# its own request (docs/services.md, "Multiplexed generation"). Credit goes back in steps of
# half the window, one frame per CREDIT_STEP results rather than one per result.
WINDOW = 32
CREDIT_STEP = WINDOW // 2

# The writer sends at most one message per this many seconds while frames keep coming, as
# the proxy's writer does (areal_proxy.serving.multiplex.COALESCE_S).
COALESCE_S = 0.002

# A request body over this many bytes goes in a call of its own, not as a frame on the
# shared stream: messages on one HTTP/2 stream travel in order, so a frame of megabytes
# would hold every small request behind it on the wire and in the proxy's reader, while
# separate calls are separate HTTP/2 streams that share the connection frame by frame.
SHARED_STREAM_MAX_BODY = 256 * 1024

_SERVICE = "/areal.proxy.v1.InferenceProxyService/"

# What a generation call sends: the message itself, or, for a body over
# SHARED_STREAM_MAX_BODY, the call's request already encoded (`generation_request`).
GenerationRequest = envelope_pb2.OpenAIRequest | bytes

# The tag of `OpenAIRequest.body` (field 2, length-delimited).
_BODY_TAG = b"\x12"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def generation_request(envelope: envelope_pb2.Envelope, body: bytes) -> GenerationRequest:
    """The request of one generation call. A small body goes in a message, for the shared
    stream. A big one is encoded here, as its own call sends it: the envelope's encoding, then
    the body field written after it (a protobuf message is the concatenation of its fields).
    Putting megabytes in a message and encoding it costs ~10 ms of GIL per 7 MB (the bytes
    are copied twice), where one join of the parts costs ~0.2 ms."""
    if len(body) <= SHARED_STREAM_MAX_BODY:
        return envelope_pb2.OpenAIRequest(envelope=envelope, body=body)
    head = envelope_pb2.OpenAIRequest(envelope=envelope).SerializeToString()
    return b"".join((head, _BODY_TAG, _varint(len(body)), body))


def _deadline(timeout_s: float | None) -> float:
    now = asyncio.get_running_loop().time()
    return now + (timeout_s if timeout_s is not None else 3600.0) + _DEADLINE_GRACE_S


def _timeout(address: str) -> ServiceError:
    log.warning("proxy %s did not answer before the deadline", address)
    return UpstreamTimeout(
        "The model's replica did not answer before the request's deadline; retry it, or give "
        "it a longer timeout."
    )


class _Waiter:
    """The results of one request on a `GenerateStream`, as they arrive.

    Its deadline is one timer for the whole request (`arm`), not one per wait: a streamed
    answer waits once per token, and a timer set and cancelled each time cost the gateway
    a heap push and pop per token."""

    __slots__ = ("consumed", "error", "expired", "future", "results", "started", "timer")

    def __init__(self) -> None:
        # At most WINDOW: the proxy sends no more than the credit it was given.
        self.results: list[proxy_pb2.GenerateResult] = []
        self.error: ServiceError | None = None  # the stream ended under this request
        self.started = False
        self.expired = False
        self.future: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        # Results taken by the client since credit for them last went back.
        self.consumed = 0

    def arm(self, deadline: float) -> None:
        """Expire at loop time `deadline` unless `disarm`ed first."""
        self.timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def push(self, result: proxy_pb2.GenerateResult) -> None:
        self.results.append(result)
        self.started = True
        self._wake()

    def fail(self, error: ServiceError) -> None:
        self.error = error
        self._wake()

    def _expire(self) -> None:
        self.timer = None
        self.expired = True
        self._wake()

    def _wake(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    async def take(self) -> list[proxy_pb2.GenerateResult]:
        """Every result that has arrived (at least one); TimeoutError once the deadline
        `arm` set has passed with none."""
        if not self.results and self.error is None and not self.expired:
            future = self.future = asyncio.get_running_loop().create_future()
            try:
                await future
            finally:
                self.future = None
        results, self.results = self.results, []
        if not results:
            if self.error is not None:
                raise self.error
            raise TimeoutError
        return results


class GenerateStream:
    """One open `Generate` call to a proxy, shared by every generation request sent there.

    Requests go out as frames and results come back as frames; one writer sends every frame
    that is ready as one message, one reader hands each result to its request. When the call
    ends, each request still waiting fails: one the proxy never read (the call ended cleanly,
    e.g. the proxy is shutting down) as `ProxyUnreachable`, so it may go elsewhere; one that
    may have run as a 502.
    """

    def __init__(self, call: Any, address: str) -> None:
        self.address = address
        self._call = call
        self._next_id = 0
        self._waiters: dict[int, _Waiter] = {}
        self._out: list[proxy_pb2.GenerateFrame] = []
        self._wake = asyncio.Event()
        self.alive = True
        self._writer = asyncio.ensure_future(self._write_loop())
        self._reader = asyncio.ensure_future(self._read_loop())

    def submit(self, kind: int, request: envelope_pb2.OpenAIRequest) -> tuple[int, _Waiter]:
        if not self.alive:
            raise ProxyUnreachable(self.address, "its stream has closed")
        self._next_id += 1
        rid = self._next_id
        waiter = self._waiters[rid] = _Waiter()
        self._send(
            proxy_pb2.GenerateFrame(id=rid, kind=kind, request=request, window=WINDOW)  # type: ignore[arg-type]
        )
        return rid, waiter

    def consumed(self, rid: int, waiter: _Waiter, n: int) -> None:
        """The client took `n` more results of `rid`: credit them back, a step at a time."""
        waiter.consumed += n
        if waiter.consumed >= CREDIT_STEP and rid in self._waiters and self.alive:
            self._send(proxy_pb2.GenerateFrame(id=rid, credit=waiter.consumed))
            waiter.consumed = 0

    def cancel(self, rid: int) -> None:
        """The request's client went away: the proxy stops it (and aborts its engine request)."""
        if self._waiters.pop(rid, None) is not None and self.alive:
            self._send(proxy_pb2.GenerateFrame(id=rid, cancel=True))

    def _send(self, frame: proxy_pb2.GenerateFrame) -> None:
        self._out.append(frame)
        self._wake.set()

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = -COALESCE_S
        try:
            while True:
                await self._wake.wait()
                # At most one message per COALESCE_S while frames keep coming (credit for
                # hundreds of streams); the first frame after a quiet spell goes at once, and
                # a lone request's never waits.
                wait = last + COALESCE_S - loop.time()
                if wait > 0 and len(self._waiters) > 1:
                    await asyncio.sleep(wait)
                self._wake.clear()
                while self._out:
                    frames, self._out = take_batch(self._out, _frame_size)
                    await self._call.write(proxy_pb2.GenerateFrames(frames=frames))
                last = loop.time()
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            # The reader sees the call's end too and fails the waiting requests.
            log.debug("stream to %s: write failed: %r", self.address, exc)

    async def _read_loop(self) -> None:
        error: ServiceError | None = None
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                for result in message.results:
                    waiter = self._waiters.get(result.id)
                    if waiter is None:
                        continue  # cancelled by us
                    if result.done:
                        del self._waiters[result.id]
                    waiter.push(result)
        except grpc.RpcError as exc:
            error = proxy_error(exc, self.address, started=True)
        except asyncio.CancelledError:
            error = Unavailable("the gateway is shutting down", code="shutting_down")
        finally:
            self._end(error)

    def _end(self, error: ServiceError | None) -> None:
        self.alive = False
        self._writer.cancel()
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            if error is None and not waiter.started:
                waiter.fail(ProxyUnreachable(self.address, "it closed the stream unread"))
            else:
                waiter.fail(
                    error
                    or UpstreamError(
                        "The model's replica closed the connection during the request; retry "
                        "the request."
                    )
                )
        if error is not None:
            log.warning("stream to proxy %s ended: %s", self.address, error.message)

    async def close(self) -> None:
        self._call.cancel()
        for task in (self._reader, self._writer):
            task.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


def _frame_size(frame: proxy_pb2.GenerateFrame) -> int:
    return len(frame.request.body)


class ProxyClient:
    """The OpenAI calls of one data proxy, on one reused channel.

    Generation goes over one `GenerateStream`, opened on first use and again after it ends,
    or with `streams=False` (--no-proxy-streams) as one gRPC call per request. Every inference
    proxy serves `Generate` (proxy and gateway ship together), so there is no fallback for
    one without it: its UNIMPLEMENTED is an error like any other.
    """

    def __init__(
        self,
        address: str,
        channel: grpc.aio.Channel,
        md: Sequence[tuple[str, str]],
        *,
        streams: bool = True,
    ):
        self.address = address
        self._channel = channel
        self._stub = proxy_pb2_grpc.InferenceProxyServiceStub(channel)
        # The generation calls for a request already encoded: gRPC sends the bytes as they are.
        response = envelope_pb2.OpenAIResponse.FromString
        chunk = envelope_pb2.StreamChunk.FromString
        self._encoded: dict[str, Any] = {
            "ChatCompletion": channel.unary_unary(
                _SERVICE + "ChatCompletion", response_deserializer=response
            ),
            "Completion": channel.unary_unary(
                _SERVICE + "Completion", response_deserializer=response
            ),
            "ChatCompletionStream": channel.unary_stream(
                _SERVICE + "ChatCompletionStream", response_deserializer=chunk
            ),
            "CompletionStream": channel.unary_stream(
                _SERVICE + "CompletionStream", response_deserializer=chunk
            ),
            "CountTokens": channel.unary_unary(
                _SERVICE + "CountTokens",
                response_deserializer=proxy_pb2.CountTokensResponse.FromString,
            ),
        }
        self._md = tuple(md)
        self._mux: GenerateStream | None = None
        self._opening: asyncio.Future[GenerateStream] | None = None
        self._streams = streams

    # -- the multiplexed stream --

    async def _open(self) -> GenerateStream:
        call = self._stub.Generate(metadata=self._md)
        try:
            # The proxy answers with its initial metadata as soon as the stream is open.
            await call.initial_metadata()
        except asyncio.CancelledError:
            call.cancel()
            raise
        if call.done():
            code = await call.code()
            if code == grpc.StatusCode.OK:
                raise ProxyUnreachable(self.address, "it is closing its streams")
            exc = grpc.aio.AioRpcError(
                code,
                grpc.aio.Metadata(),
                await call.trailing_metadata() or grpc.aio.Metadata(),
                await call.details(),
            )
            # Nothing was written: frames go out only once the stream is open (initial
            # metadata in), so a transport failure here is safe to send elsewhere.
            raise proxy_error(exc, self.address, started=False)
        stream = self._mux = GenerateStream(call, self.address)
        return stream

    async def _stream(self, deadline: float) -> GenerateStream | None:
        """The open stream (opened now if need be), or None: a call per request."""
        if not self._streams:
            return None
        stream = self._mux
        if stream is not None and stream.alive:
            return stream
        opening = self._opening
        if opening is None or opening.done():
            opening = self._opening = asyncio.ensure_future(self._open())
        # Shared by every request that arrives while it opens; each waits as long as it may.
        timeout = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(opening), max(timeout, 0))
        except TimeoutError:
            raise _timeout(self.address) from None

    def _method(self, rpc: str, request: GenerationRequest) -> Any:
        return self._encoded[rpc] if isinstance(request, bytes) else getattr(self._stub, rpc)

    async def _whole(
        self, kind: int, rpc: str, request: GenerationRequest, timeout_s: float | None
    ) -> bytes:
        deadline = _deadline(timeout_s)
        # A request already encoded has a body too big for the shared stream.
        if isinstance(request, bytes) or (stream := await self._stream(deadline)) is None:
            return await self._unary(self._method(rpc, request), request, timeout_s)
        rid, waiter = stream.submit(kind, request)
        waiter.arm(deadline)
        done = False
        try:
            try:
                results = await waiter.take()
            except TimeoutError:
                raise _timeout(self.address) from None
            done = True
            result = results[0]
            if result.HasField("error"):
                raise ServiceError.from_detail(result.error)
            return bytes(result.data)
        finally:
            waiter.disarm()
            if not done:
                stream.cancel(rid)

    async def _chunks(
        self, kind: int, rpc: str, request: GenerationRequest, timeout_s: float | None
    ) -> AsyncIterator[list[bytes]]:
        deadline = _deadline(timeout_s)
        if isinstance(request, bytes) or (stream := await self._stream(deadline)) is None:
            async for part in self._call_stream(self._method(rpc, request), request, timeout_s):
                yield part
            return
        rid, waiter = stream.submit(kind, request)
        waiter.arm(deadline)
        done = False
        try:
            while not done:
                try:
                    results = await waiter.take()
                except TimeoutError:
                    raise _timeout(self.address) from None
                # Taken when the client asks for more, i.e. once it has read the last batch.
                stream.consumed(rid, waiter, len(results))
                batch: list[bytes] = []
                for result in results:
                    if result.HasField("error"):
                        done = True
                        if batch:
                            yield batch
                        raise ServiceError.from_detail(result.error)
                    if result.data:
                        batch.append(bytes(result.data))
                    done = done or result.done
                if batch:
                    yield batch
        finally:
            waiter.disarm()
            if not done:
                stream.cancel(rid)

    # -- one gRPC call per request (--no-proxy-streams) --

    async def _unary(
        self, method: Any, request: GenerationRequest, timeout_s: float | None
    ) -> bytes:
        # The request leaves with the call: whether it may go elsewhere is decided before.
        await ensure_connected(self._channel, self.address, min(timeout_s or 3600.0, 5.0))
        call = method(request, timeout=timeout_s, metadata=self._md)
        try:
            resp = await call
        except grpc.RpcError as exc:
            raise proxy_error(exc, self.address, started=True) from None
        except asyncio.CancelledError:
            call.cancel()
            raise
        return bytes(resp.body)

    async def _call_stream(
        self, method: Any, request: GenerationRequest, timeout_s: float | None
    ) -> AsyncIterator[list[bytes]]:
        await ensure_connected(self._channel, self.address, min(timeout_s or 3600.0, 5.0))
        call = method(request, timeout=timeout_s, metadata=self._md)
        async for msg in read_messages(call, self.address):
            yield [bytes(msg.data)]

    # -- generation: whole bodies, or streams as batches of chunks that arrived together --

    async def chat_completion(self, request: GenerationRequest, timeout_s: float | None) -> bytes:
        return await self._whole(_CHAT, "ChatCompletion", request, timeout_s)

    async def completion(self, request: GenerationRequest, timeout_s: float | None) -> bytes:
        return await self._whole(_COMPLETION, "Completion", request, timeout_s)

    def chat_completion_stream(
        self, request: GenerationRequest, timeout_s: float | None
    ) -> AsyncIterator[list[bytes]]:
        return self._chunks(_CHAT, "ChatCompletionStream", request, timeout_s)

    def completion_stream(
        self, request: GenerationRequest, timeout_s: float | None
    ) -> AsyncIterator[list[bytes]]:
        return self._chunks(_COMPLETION, "CompletionStream", request, timeout_s)

    async def count_tokens(self, request: GenerationRequest, timeout_s: float | None) -> int:
        """The prompt size of a chat request (`CountTokens`): rendered and tokenized by the
        proxy, nothing generated or recorded. One call of its own, never on the shared
        stream (which carries generations only)."""
        await ensure_connected(self._channel, self.address, min(timeout_s or 3600.0, 5.0))
        call = self._method("CountTokens", request)(
            request, timeout=timeout_s, metadata=tracing.metadata(self._md)
        )
        try:
            resp = await call
        except grpc.RpcError as exc:
            raise proxy_error(exc, self.address, started=True) from None
        except asyncio.CancelledError:
            call.cancel()
            raise
        return int(resp.input_tokens)

    async def close(self, grace: float | None = None) -> None:
        if self._mux is not None:
            await self._mux.close()
        await self._channel.close(grace)

    # -- RL sessions and generation control (unary, never generation: safe to fail fast) --

    async def _call(
        self, method: Any, request: Any, timeout_s: float | None = ROUTER_TIMEOUT
    ) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=tracing.metadata(self._md))
        except grpc.RpcError as exc:
            raise proxy_error(exc, self.address, started=True) from None

    async def start_sessions(
        self, request: proxy_pb2.StartSessionsRequest
    ) -> proxy_pb2.StartSessionsResponse:
        return await self._call(self._stub.StartSessions, request)

    async def end_sessions(self, request: proxy_pb2.EndSessionsRequest) -> int:
        return int((await self._call(self._stub.EndSessions, request)).ended)

    async def set_reward(self, request: proxy_pb2.SetRewardRequest) -> proxy_pb2.SetRewardResponse:
        return await self._call(self._stub.SetReward, request)

    async def session_status(self, request: proxy_pb2.GetSessionRequest) -> dict[str, Any]:
        """A session's status, as the JSON object the proxy made (`GetSession`)."""
        out = await self._call(self._stub.GetSession, request)
        try:
            status = orjson.loads(out.status)
        except orjson.JSONDecodeError:
            status = None
        if not isinstance(status, dict):
            log.warning("proxy %s sent a session status that is no object", self.address)
            raise UpstreamError("The session's replica sent a malformed status; retry.")
        return status

    async def export(
        self,
        request: proxy_pb2.ExportTrajectoriesRequest,
        timeout_s: float | None,
        summaries: list[bytes] | None = None,
    ) -> AsyncIterator[bytes]:
        """JSON lines of exported rows, chunk by chunk as the proxy reads them; the export's
        summary (its last chunk; none from an older proxy) goes to `summaries`."""
        call = self._stub.ExportTrajectories(request, timeout=timeout_s, metadata=self._md)
        async for msg in read_messages(call, self.address):
            if msg.summary and summaries is not None:
                summaries.append(bytes(msg.summary))
            if msg.jsonl:
                yield bytes(msg.jsonl)

    async def ack_export(self, request: proxy_pb2.AckExportRequest) -> proxy_pb2.AckExportResponse:
        """Remove what an export with removal claimed here (its client has every row)."""
        return await self._call(self._stub.AckExport, request)

    async def check_token(self, timeout_s: float = 2.0) -> None:
        """Raise `InternalAuthFailed` when this proxy refuses the gateway's internal token
        (one `GetStats`, which every proxy serves and which carries the token). Any other
        failure (not up yet, slow) is no finding: the router's health polls cover it."""
        stub = proxy_pb2_grpc.ProxyStatusServiceStub(self._channel)
        try:
            await stub.GetStats(proxy_pb2.GetStatsRequest(), timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            err = proxy_error(exc, self.address, started=True)
            if isinstance(err, InternalAuthFailed):
                raise err from None

    async def control(
        self, action: str, request: Any, timeout_s: float | None
    ) -> proxy_pb2.ControlResponse:
        method = {
            "pause": self._stub.Pause,
            "continue": self._stub.Continue,
            "set_version": self._stub.SetVersion,
            "update_weights": self._stub.UpdateWeights,
        }[action]
        return await self._call(method, request, timeout_s)

    async def retire(
        self, request: proxy_pb2.RetireRequest, timeout_s: float
    ) -> proxy_pb2.RetireResponse:
        return await self._call(self._stub.Retire, request, timeout_s)


class ProxyPool:
    """One `ProxyClient` (one channel) per proxy address, made on first use and reused."""

    def __init__(self, token: str, *, streams: bool = True) -> None:
        self._md = call_metadata(token)
        self._streams = streams
        self._clients: dict[str, ProxyClient] = {}

    def get(self, address: str) -> ProxyClient:
        client = self._clients.get(address)
        if client is None:
            client = ProxyClient(address, open_channel(address), self._md, streams=self._streams)
            self._clients[address] = client
        return client

    def __len__(self) -> int:
        return len(self._clients)

    async def close(self, grace: float | None = None) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close(grace) for c in clients), return_exceptions=True)
