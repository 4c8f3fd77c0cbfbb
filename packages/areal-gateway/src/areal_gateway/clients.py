"""The only module that touches gRPC stubs (docs/services.md, "Internal gRPC calls").

`RouterClient` wraps the router; `ProxyPool` hands out one `ProxyClient` per proxy address,
each on one channel that every request to that address reuses. Every call carries the
internal token as metadata (computed once, not per call). Failed calls surface as
`ServiceError` (or its subclass `ProxyUnreachable`), never as `grpc.RpcError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_proto.service.auth import call_metadata
from areal_proto.service.batching import take_batch
from areal_proto.service.errors import ERROR_METADATA_KEY, ServiceError, from_rpc_error

log = logging.getLogger(__name__)

# Seconds for router calls (routing, registry): these are cheap and never generate.
ROUTER_TIMEOUT = 10.0

# A restarted replica at the same address must be reachable again quickly: gRPC's default
# reconnect back-off grows to 120 s.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)

# What grpc reports when it could not open a connection to the target at all.
_CONNECT_FAILURE_MARKERS = (
    "failed to connect",
    "connection refused",
    "connect failed",
    "dns resolution failed",
)


class ProxyUnreachable(ServiceError):
    """The proxy could not be reached: the call never started there, so it may go elsewhere."""

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(503, f"proxy {address} is unreachable: {detail}", code="proxy_unreachable")
        self.address = address


def _has_detail(exc: grpc.RpcError) -> bool:
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(key == ERROR_METADATA_KEY for key, _ in trailing or ())


def _is_connect_failure(exc: grpc.RpcError) -> bool:
    if not hasattr(exc, "code") or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = (exc.details() or "").lower() if hasattr(exc, "details") else ""
    return any(marker in details for marker in _CONNECT_FAILURE_MARKERS)


def _proxy_error(exc: grpc.RpcError, address: str, *, started: bool) -> ServiceError:
    """Map a failed proxy call: its own OpenAI error passes through; a transport failure is a
    bad gateway (502), except that a refused connection before anything arrived is
    `ProxyUnreachable` (retryable on another replica)."""
    if _has_detail(exc):
        return from_rpc_error(exc, target="proxy")
    if not started and _is_connect_failure(exc):
        return ProxyUnreachable(address, exc.details() or "connection failed")
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServiceError(
            502,
            f"proxy {address} failed: {exc.details() or 'unavailable'}",
            type="api_error",
            code="upstream_error",
        )
    return from_rpc_error(exc, target=f"proxy {address}")


_CHAT = proxy_pb2.GENERATE_KIND_CHAT
_COMPLETION = proxy_pb2.GENERATE_KIND_COMPLETION

# The gateway waits this much past a request's deadline for the proxy's own 504, which
# says more than a transport timeout.
_DEADLINE_GRACE_S = 0.05


def _deadline(timeout_s: float | None) -> float:
    now = asyncio.get_running_loop().time()
    return now + (timeout_s if timeout_s is not None else 3600.0) + _DEADLINE_GRACE_S


def _timeout(address: str) -> ServiceError:
    return ServiceError(
        504, f"proxy {address} did not answer before the deadline", code="upstream_timeout"
    )


def _channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class RouterClient:
    """Plain async methods over the router's gRPC API."""

    def __init__(self, address: str, token: str) -> None:
        self.address = address
        self._channel = _channel(address)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._md = call_metadata(token)
        # Bumped by every registry change made through this client: route leases granted
        # before it are void (routing.RouteTable).
        self.epoch = 0

    async def _call(self, method: Any, request: Any, timeout_s: float = ROUTER_TIMEOUT) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, target="router") from None

    async def _change(self, method: Any, request: Any) -> Any:
        """A registry change: leases granted before it ends, or while it runs, are void."""
        self.epoch += 1
        try:
            return await self._call(method, request)
        finally:
            self.epoch += 1

    async def route(
        self,
        model: str,
        *,
        session_id: str = "",
        kind: int = router_pb2.PROXY_KIND_INFERENCE,
        want_lease: bool = False,
        prefix_hashes: list[int] | None = None,
        timeout_s: float = ROUTER_TIMEOUT,
    ) -> router_pb2.RouteResponse:
        req = router_pb2.RouteRequest(
            model=model,
            session_id=session_id,
            kind=kind,  # type: ignore[arg-type]
            want_lease=want_lease,
            prefix_hashes=prefix_hashes or (),
        )
        return await self._call(self._stub.Route, req, timeout_s)

    async def list_models(self) -> list[router_pb2.ModelInfo]:
        resp = await self._call(self._stub.ListModels, router_pb2.ListModelsRequest())
        return list(resp.models)

    async def list_proxies(self, model: str = "", kind: int = 0) -> list[router_pb2.ProxyInfo]:
        req = router_pb2.ListProxiesRequest(model=model, kind=kind)  # type: ignore[arg-type]
        resp = await self._call(self._stub.ListProxies, req)
        return list(resp.proxies)

    async def register_model(self, model: router_pb2.ModelInfo) -> None:
        await self._change(self._stub.RegisterModel, router_pb2.RegisterModelRequest(model=model))

    async def deregister_model(self, name: str) -> tuple[bool, list[str]]:
        resp = await self._change(
            self._stub.DeregisterModel, router_pb2.DeregisterModelRequest(name=name)
        )
        return bool(resp.existed), list(resp.proxy_ids)

    async def register_proxy(self, proxy: router_pb2.ProxyInfo) -> None:
        await self._change(self._stub.RegisterProxy, router_pb2.RegisterProxyRequest(proxy=proxy))

    async def deregister_proxy(self, proxy_id: str) -> bool:
        resp = await self._change(
            self._stub.DeregisterProxy, router_pb2.DeregisterProxyRequest(proxy_id=proxy_id)
        )
        return bool(resp.existed)

    async def warm(self, timeout_s: float = 2.0) -> bool:
        """Open the channel now, so the first request does not pay for the connection."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except (TimeoutError, grpc.RpcError):
            return False
        return True

    async def bind_sessions(
        self, session_ids: Sequence[str], model: str, *, kind: int = router_pb2.PROXY_KIND_INFERENCE
    ) -> router_pb2.BindSessionResponse:
        req = router_pb2.BindSessionRequest(session_ids=list(session_ids), model=model, kind=kind)  # type: ignore[arg-type]
        return await self._call(self._stub.BindSession, req)

    async def release_sessions(self, session_ids: Sequence[str]) -> int:
        req = router_pb2.ReleaseSessionRequest(session_ids=list(session_ids))
        resp = await self._call(self._stub.ReleaseSession, req)
        return int(resp.released)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)


class _Waiter:
    """The results of one request on a `GenerateStream`, as they arrive."""

    __slots__ = ("error", "future", "results", "started")

    def __init__(self) -> None:
        self.results: list[proxy_pb2.GenerateResult] = []
        self.error: ServiceError | None = None  # the stream ended under this request
        self.started = False
        self.future: asyncio.Future[None] | None = None

    def push(self, result: proxy_pb2.GenerateResult) -> None:
        self.results.append(result)
        self.started = True
        self._wake()

    def fail(self, error: ServiceError) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    async def take(self, deadline: float) -> list[proxy_pb2.GenerateResult]:
        """Every result that has arrived (at least one), waiting until loop time `deadline`."""
        if not self.results and self.error is None:
            loop = asyncio.get_running_loop()
            future = self.future = loop.create_future()
            timer = loop.call_at(deadline, _expire, future)
            try:
                await future
            finally:
                timer.cancel()
                self.future = None
        results, self.results = self.results, []
        if not results and self.error is not None:
            raise self.error
        return results


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


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
        self._send(proxy_pb2.GenerateFrame(id=rid, kind=kind, request=request))  # type: ignore[arg-type]
        return rid, waiter

    def cancel(self, rid: int) -> None:
        """The request's client went away: the proxy stops it (and aborts its engine request)."""
        if self._waiters.pop(rid, None) is not None and self.alive:
            self._send(proxy_pb2.GenerateFrame(id=rid, cancel=True))

    def _send(self, frame: proxy_pb2.GenerateFrame) -> None:
        self._out.append(frame)
        self._wake.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._out:
                    frames, self._out = take_batch(self._out, _frame_size)
                    await self._call.write(proxy_pb2.GenerateFrames(frames=frames))
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
            error = _proxy_error(exc, self.address, started=True)
        except asyncio.CancelledError:
            error = ServiceError(503, "the gateway is shutting down", code="shutting_down")
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
                    or ServiceError(
                        502,
                        f"proxy {self.address} closed the stream mid-request",
                        type="api_error",
                        code="upstream_error",
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


class _Legacy(Exception):
    """The proxy has no `Generate` (an older proxy): use one call per request."""


class ProxyClient:
    """The OpenAI calls of one data proxy, on one reused channel.

    Generation goes over one `GenerateStream`, opened on first use and again after it ends;
    a proxy without `Generate` gets one gRPC call per request instead.
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
        self._stub = proxy_pb2_grpc.ProxyServiceStub(channel)
        self._md = tuple(md)
        self._mux: GenerateStream | None = None
        self._opening: asyncio.Future[GenerateStream] | None = None
        # One call per request: asked for (--no-proxy-streams), or the proxy has no Generate.
        self._legacy = not streams

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
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self._legacy = True
                raise _Legacy()
            if code == grpc.StatusCode.OK:
                raise ProxyUnreachable(self.address, "it is closing its streams")
            exc = grpc.aio.AioRpcError(
                code,
                grpc.aio.Metadata(),
                await call.trailing_metadata() or grpc.aio.Metadata(),
                await call.details(),
            )
            raise _proxy_error(exc, self.address, started=False)
        stream = self._mux = GenerateStream(call, self.address)
        return stream

    async def _stream(self, deadline: float) -> GenerateStream:
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

    async def _whole(
        self, kind: int, method: Any, request: envelope_pb2.OpenAIRequest, timeout_s: float | None
    ) -> bytes:
        if self._legacy:
            return await self._unary(method, request, timeout_s)
        deadline = _deadline(timeout_s)
        try:
            stream = await self._stream(deadline)
        except _Legacy:
            return await self._unary(method, request, timeout_s)
        rid, waiter = stream.submit(kind, request)
        done = False
        try:
            try:
                results = await waiter.take(deadline)
            except TimeoutError:
                raise _timeout(self.address) from None
            done = True
            result = results[0]
            if result.HasField("error"):
                raise ServiceError.from_detail(result.error)
            return bytes(result.data)
        finally:
            if not done:
                stream.cancel(rid)

    async def _chunks(
        self, kind: int, method: Any, request: envelope_pb2.OpenAIRequest, timeout_s: float | None
    ) -> AsyncIterator[list[bytes]]:
        if self._legacy:
            async for part in self._call_stream(method, request, timeout_s):
                yield part
            return
        deadline = _deadline(timeout_s)
        try:
            stream = await self._stream(deadline)
        except _Legacy:
            async for part in self._call_stream(method, request, timeout_s):
                yield part
            return
        rid, waiter = stream.submit(kind, request)
        done = False
        try:
            while not done:
                try:
                    results = await waiter.take(deadline)
                except TimeoutError:
                    raise _timeout(self.address) from None
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
            if not done:
                stream.cancel(rid)

    # -- one gRPC call per request (a proxy without Generate) --

    async def _unary(
        self, method: Any, request: envelope_pb2.OpenAIRequest, timeout_s: float | None
    ) -> bytes:
        call = method(request, timeout=timeout_s, metadata=self._md)
        try:
            resp = await call
        except grpc.RpcError as exc:
            raise _proxy_error(exc, self.address, started=False) from None
        except asyncio.CancelledError:
            call.cancel()
            raise
        return bytes(resp.body)

    async def _call_stream(
        self, method: Any, request: envelope_pb2.OpenAIRequest, timeout_s: float | None
    ) -> AsyncIterator[list[bytes]]:
        call = method(request, timeout=timeout_s, metadata=self._md)
        started = False
        try:
            while True:
                try:
                    msg = await call.read()
                except grpc.RpcError as exc:
                    raise _proxy_error(exc, self.address, started=started) from None
                if msg is grpc.aio.EOF:
                    return
                started = True
                yield [bytes(msg.data)]
        finally:
            # Client gone, consumer stopped, or an error: the proxy must see the cancellation.
            if not call.done():
                call.cancel()

    # -- generation: whole bodies, or streams as batches of chunks that arrived together --

    async def chat_completion(
        self, request: envelope_pb2.OpenAIRequest, timeout_s: float | None
    ) -> bytes:
        return await self._whole(_CHAT, self._stub.ChatCompletion, request, timeout_s)

    async def completion(
        self, request: envelope_pb2.OpenAIRequest, timeout_s: float | None
    ) -> bytes:
        return await self._whole(_COMPLETION, self._stub.Completion, request, timeout_s)

    def chat_completion_stream(
        self, request: envelope_pb2.OpenAIRequest, timeout_s: float | None
    ) -> AsyncIterator[list[bytes]]:
        return self._chunks(_CHAT, self._stub.ChatCompletionStream, request, timeout_s)

    def completion_stream(
        self, request: envelope_pb2.OpenAIRequest, timeout_s: float | None
    ) -> AsyncIterator[list[bytes]]:
        return self._chunks(_COMPLETION, self._stub.CompletionStream, request, timeout_s)

    async def close(self, grace: float | None = None) -> None:
        if self._mux is not None:
            await self._mux.close()
        await self._channel.close(grace)

    # -- RL sessions and generation control (unary, never generation: safe to fail fast) --

    async def _call(
        self, method: Any, request: Any, timeout_s: float | None = ROUTER_TIMEOUT
    ) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            raise _proxy_error(exc, self.address, started=True) from None

    async def start_sessions(
        self, request: proxy_pb2.StartSessionsRequest
    ) -> proxy_pb2.StartSessionsResponse:
        return await self._call(self._stub.StartSessions, request)

    async def end_sessions(self, request: proxy_pb2.EndSessionsRequest) -> int:
        return int((await self._call(self._stub.EndSessions, request)).ended)

    async def set_reward(self, request: proxy_pb2.SetRewardRequest) -> proxy_pb2.SetRewardResponse:
        return await self._call(self._stub.SetReward, request)

    async def export(
        self, request: proxy_pb2.ExportTrajectoriesRequest, timeout_s: float | None
    ) -> AsyncIterator[bytes]:
        """JSON lines of exported rows, chunk by chunk as the proxy reads them."""
        call = self._stub.ExportTrajectories(request, timeout=timeout_s, metadata=self._md)
        try:
            while True:
                try:
                    msg = await call.read()
                except grpc.RpcError as exc:
                    raise _proxy_error(exc, self.address, started=True) from None
                if msg is grpc.aio.EOF:
                    return
                yield bytes(msg.jsonl)
        finally:
            if not call.done():
                call.cancel()

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


class ProxyPool:
    """One `ProxyClient` (one channel) per proxy address, made on first use and reused."""

    def __init__(self, token: str, *, streams: bool = True) -> None:
        self._md = call_metadata(token)
        self._streams = streams
        self._clients: dict[str, ProxyClient] = {}

    def get(self, address: str) -> ProxyClient:
        client = self._clients.get(address)
        if client is None:
            client = ProxyClient(address, _channel(address), self._md, streams=self._streams)
            self._clients[address] = client
        return client

    def __len__(self) -> int:
        return len(self._clients)

    async def close(self, grace: float | None = None) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close(grace) for c in clients), return_exceptions=True)


# --- agent mode ---------------------------------------------------------------------------------

# Metadata naming the session key a non-admin caller presented, on the agent RPCs whose
# request carries no envelope (close, history): the proxy checks it against the session's hash.
SESSION_KEY_METADATA = "x-areal-session-key"


class AgentProxyClient:
    """The agent-mode RPCs of one data proxy (sessions, turns, rewards, export)."""

    def __init__(self, address: str, channel: grpc.aio.Channel, md: Sequence[tuple[str, str]]):
        self.address = address
        self._channel = channel
        self._stub = proxy_pb2_grpc.ProxyServiceStub(channel)
        self._md = tuple(md)

    def _keyed(self, session_key: str) -> tuple[tuple[str, str], ...]:
        return (*self._md, (SESSION_KEY_METADATA, session_key)) if session_key else self._md

    async def _unary(
        self, method: Any, request: Any, timeout_s: float | None, md: Sequence[tuple[str, str]]
    ) -> Any:
        call = method(request, timeout=timeout_s, metadata=md)
        try:
            return await call
        except grpc.RpcError as exc:
            raise _proxy_error(exc, self.address, started=False) from None
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def create_session(
        self, session_id: str, session_key: str, metadata: bytes, timeout_s: float | None = 60.0
    ) -> proxy_pb2.CreateAgentSessionResponse:
        req = proxy_pb2.CreateAgentSessionRequest(
            session_id=session_id, session_api_key=session_key, metadata=metadata
        )
        return await self._unary(self._stub.CreateAgentSession, req, timeout_s, self._md)

    async def close_session(
        self, session_id: str, session_key: str = "", timeout_s: float | None = 30.0
    ) -> bool:
        """`session_key` empty: the caller is the admin."""
        req = proxy_pb2.CloseAgentSessionRequest(session_id=session_id)
        resp = await self._unary(
            self._stub.CloseAgentSession, req, timeout_s, self._keyed(session_key)
        )
        return bool(resp.existed)

    async def history(
        self, session_id: str, session_key: str = "", timeout_s: float | None = 30.0
    ) -> bytes:
        req = proxy_pb2.GetAgentHistoryRequest(session_id=session_id)
        resp = await self._unary(
            self._stub.GetAgentHistory, req, timeout_s, self._keyed(session_key)
        )
        return bytes(resp.history)

    async def set_reward(
        self, request: proxy_pb2.SetRewardRequest, timeout_s: float | None = 60.0
    ) -> proxy_pb2.SetRewardResponse:
        return await self._unary(self._stub.SetReward, request, timeout_s, self._md)

    async def turn(
        self, request: proxy_pb2.AgentTurnRequest, timeout_s: float | None
    ) -> AsyncIterator[tuple[str, bytes]]:
        """(event type, JSON data) as the agent emits them; a failure is a `ServiceError`."""
        call = self._stub.AgentTurn(request, timeout=timeout_s, metadata=self._md)
        started = False
        try:
            while True:
                try:
                    msg = await call.read()
                except grpc.RpcError as exc:
                    raise _proxy_error(exc, self.address, started=started) from None
                if msg is grpc.aio.EOF:
                    return
                started = True
                yield msg.type, bytes(msg.data)
        finally:
            # Client gone or consumer stopped: the proxy (and the agent) must see it.
            if not call.done():
                call.cancel()

    async def export(
        self, request: proxy_pb2.ExportTrajectoriesRequest, timeout_s: float | None
    ) -> list[bytes]:
        """The exported rows as JSON-lines chunks."""
        call = self._stub.ExportTrajectories(request, timeout=timeout_s, metadata=self._md)
        chunks: list[bytes] = []
        try:
            while True:
                try:
                    msg = await call.read()
                except grpc.RpcError as exc:
                    raise _proxy_error(exc, self.address, started=True) from None
                if msg is grpc.aio.EOF:
                    return chunks
                chunks.append(bytes(msg.jsonl))
        finally:
            if not call.done():
                call.cancel()


class AgentProxyPool:
    """One `AgentProxyClient` (one channel) per agent proxy address, reused."""

    def __init__(self, token: str) -> None:
        self._md = call_metadata(token)
        self._clients: dict[str, AgentProxyClient] = {}

    def get(self, address: str) -> AgentProxyClient:
        client = self._clients.get(address)
        if client is None:
            client = AgentProxyClient(address, _channel(address), self._md)
            self._clients[address] = client
        return client

    async def close(self, grace: float | None = None) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c._channel.close(grace) for c in clients), return_exceptions=True)
