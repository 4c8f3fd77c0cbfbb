"""Test doubles for the gateway's neighbours: a FAKE router, a FAKE data proxy (both real
grpc.aio servers on loopback) and a FAKE OpenAI-compatible upstream (real HTTP). They do just
enough for the gateway's tests; none of them is the real service.

A fake proxy's behaviour for one request is steered by an optional `"fake"` object in the
request body (the gateway forwards unknown fields untouched, so it reaches the fake as sent).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_runtime.auth import InternalTokenInterceptor, call_metadata
from areal_runtime.errors import ServiceError, abort

TOKEN = "test-internal-token-0123456789"


class BackgroundLoop:
    """An event loop in a thread, hosting the fakes and the gateway under test, so tests may
    use blocking clients (the sync OpenAI SDK) as well as their own async ones."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fakes", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def start_grpc(servicer: Any, *adds: Any) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[InternalTokenInterceptor(TOKEN)])
    for add in adds:
        add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def serve_models(stack: Any, servicer: Any, models: tuple[str, ...]) -> grpc.aio.Server:
    """Serve `servicer` as the one healthy inference proxy of each of `models` (registered
    straight in the stack's fake router); the caller stops the returned server."""
    server, port = stack.bg.run(start_grpc(servicer, *PROXY_SERVICES))
    for model in models:
        stack.router.models[model] = router_pb2.ModelInfo(
            name=model, kind=router_pb2.MODEL_KIND_INTERNAL, created_unix_s=1700000000
        )
        stack.router.proxies[f"{model}-scripted"] = router_pb2.ProxyInfo(
            proxy_id=f"{model}-scripted",
            address=f"127.0.0.1:{port}",
            model=model,
            kind=router_pb2.PROXY_KIND_INFERENCE,
            health=router_pb2.PROXY_HEALTH_HEALTHY,
        )
    return server


# --- FAKE router -------------------------------------------------------------------------------


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.models: dict[str, router_pb2.ModelInfo] = {}
        self.proxies: dict[str, router_pb2.ProxyInfo] = {}
        self.routes: list[router_pb2.RouteRequest] = []
        self.list_models_calls = 0
        # Session (or group) pins: id -> proxy id. A Route naming one goes to its proxy; one
        # naming an unknown id and no model is a 404, as the real router answers.
        self.pins: dict[str, str] = {}
        self._rr = itertools.count()
        self.binds: list[router_pb2.BindSessionRequest] = []

    def set_health(self, proxy_id: str, health: int) -> None:
        self.proxies[proxy_id].health = health  # type: ignore[assignment]

    async def RegisterModel(self, request: Any, context: Any) -> Any:
        if request.model.name in self.models:
            await abort(context, ServiceError(409, f"model {request.model.name} exists"))
        self.models[request.model.name] = request.model
        return router_pb2.RegisterModelResponse()

    async def DeregisterModel(self, request: Any, context: Any) -> Any:
        existed = self.models.pop(request.name, None) is not None
        ids = [p.proxy_id for p in self.proxies.values() if p.model == request.name]
        for i in ids:
            del self.proxies[i]
        return router_pb2.DeregisterModelResponse(existed=existed, proxy_ids=sorted(ids))

    async def RegisterProxy(self, request: Any, context: Any) -> Any:
        p = router_pb2.ProxyInfo()
        p.CopyFrom(request.proxy)
        p.health = router_pb2.PROXY_HEALTH_HEALTHY
        p.inflight_requests = 3
        p.inflight_tokens = 42
        self.proxies[p.proxy_id] = p
        return router_pb2.RegisterProxyResponse()

    async def RegisterProxies(self, request: Any, context: Any) -> Any:
        """As the real router: each proxy registered, then polled once with the service's
        token; one that refuses it is named in `refused_token`."""
        refused = []
        for info in request.proxies:
            await self.RegisterProxy(router_pb2.RegisterProxyRequest(proxy=info), context)
            async with grpc.aio.insecure_channel(info.address) as channel:
                stub = proxy_pb2_grpc.ProxyStatusServiceStub(channel)
                try:
                    await stub.GetStats(
                        proxy_pb2.GetStatsRequest(), timeout=2, metadata=call_metadata(TOKEN)
                    )
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                        refused.append(info.proxy_id)
        return router_pb2.RegisterProxiesResponse(
            proxies=[self.proxies[p.proxy_id] for p in request.proxies], refused_token=refused
        )

    async def DeregisterProxy(self, request: Any, context: Any) -> Any:
        return router_pb2.DeregisterProxyResponse(
            existed=self.proxies.pop(request.proxy_id, None) is not None
        )

    async def Route(self, request: Any, context: Any) -> Any:
        self.routes.append(request)
        pinned = self.proxies.get(self.pins.get(request.session_id, ""))
        if pinned is not None:
            return router_pb2.RouteResponse(
                proxy_id=pinned.proxy_id, address=pinned.address, model=self.models[pinned.model]
            )
        if request.session_id and not request.model:
            await abort(
                context,
                ServiceError(
                    404,
                    f"session {request.session_id!r} is not known to the router",
                    code="session_not_found",
                ),
            )
        model = self.models.get(request.model)
        if model is None:
            await abort(
                context,
                ServiceError(
                    404,
                    f"The model '{request.model}' does not exist",
                    code="model_not_found",
                    param="model",
                ),
            )
        assert model is not None
        if model.kind == router_pb2.MODEL_KIND_EXTERNAL:
            return router_pb2.RouteResponse(model=model)
        healthy = [
            p
            for p in sorted(self.proxies.values(), key=lambda p: p.proxy_id)
            if p.model == request.model and p.health == router_pb2.PROXY_HEALTH_HEALTHY
        ]
        if not healthy:
            await abort(
                context,
                ServiceError(
                    503, f"no healthy replica for model {request.model}", code="no_healthy_replica"
                ),
            )
        p = healthy[next(self._rr) % len(healthy)]
        return router_pb2.RouteResponse(proxy_id=p.proxy_id, address=p.address, model=model)

    async def ListProxies(self, request: Any, context: Any) -> Any:
        return router_pb2.ListProxiesResponse(
            proxies=[
                p for p in self.proxies.values() if not request.model or p.model == request.model
            ]
        )

    async def ListModels(self, request: Any, context: Any) -> Any:
        self.list_models_calls += 1
        out = []
        for m in self.models.values():
            info = router_pb2.ModelInfo()
            info.CopyFrom(m)
            info.proxy_ids.extend(p.proxy_id for p in self.proxies.values() if p.model == m.name)
            out.append(info)
        return router_pb2.ListModelsResponse(models=out)

    # Admission: a test sets `refuse_starts` to the refusal every BindSession with admission
    # answers (the rule itself is the real router's, tested there).
    refuse_starts: ServiceError | None = None

    async def BindSession(self, request: Any, context: Any) -> Any:
        self.binds.append(request)
        if request.HasField("admission") and self.refuse_starts is not None:
            await abort(context, self.refuse_starts)
        proxy = next(p for p in self.proxies.values() if p.model == request.model)
        for sid in request.session_ids:
            self.pins[sid] = proxy.proxy_id
        return router_pb2.BindSessionResponse(proxy_id=proxy.proxy_id, address=proxy.address)


# Registers a FakeProxy's services, as an inference proxy does.
PROXY_SERVICES = (
    proxy_pb2_grpc.add_InferenceProxyServiceServicer_to_server,
    proxy_pb2_grpc.add_ProxyStatusServiceServicer_to_server,
)


# --- FAKE data proxy -----------------------------------------------------------------------------


@dataclass
class Received:
    method: str
    envelope: envelope_pb2.Envelope
    body: bytes
    metadata: dict[str, str]
    time_remaining: float | None


@dataclass
class FakeProxy(
    proxy_pb2_grpc.InferenceProxyServiceServicer, proxy_pb2_grpc.ProxyStatusServiceServicer
):
    """An inference proxy with the per-call RPCs only: gateways in front of it run with
    proxy_streams=False (test_generate_stream.py covers the Generate stream)."""

    proxy_id: str
    received: list[Received] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    produced: list[tuple[str, int, float]] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    gate_timed_out: list[str] = field(default_factory=list)
    # What GetStats reports as the served model (a real router checks it).
    model: str = ""
    # GetSession's answers: session id -> status (as the real proxy's SessionBook.status).
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    # ExportTrajectories: the requests it got, and the rows it answers each session with.
    exports: list[Any] = field(default_factory=list)
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def _record(self, method: str, request: Any, context: Any) -> dict[str, Any]:
        md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        self.received.append(
            Received(method, request.envelope, request.body, md, context.time_remaining())
        )
        doc = orjson.loads(request.body)
        return doc.get("fake") or {}

    async def _check(self, doc_fake: dict[str, Any], request: Any, context: Any) -> None:
        doc = orjson.loads(request.body)
        if isinstance(doc.get("max_tokens"), int) and doc["max_tokens"] < 1:
            await abort(
                context,
                ServiceError(
                    400, "max_tokens must be at least 1", code="invalid_value", param="max_tokens"
                ),
            )
        if self.proxy_id in doc_fake.get("draining_on", ()):
            await abort(context, ServiceError(503, "fake proxy draining", code="draining"))
        if "error_status" in doc_fake:
            message = doc_fake.get("error_message", "fake proxy error")
            err = ServiceError(doc_fake["error_status"], message, code=doc_fake.get("error_code"))
            if doc_fake.get("retry_after_s"):
                err.retry_after_s = int(doc_fake["retry_after_s"])
            await abort(context, err)
        if doc_fake.get("crash"):
            raise RuntimeError("fake proxy crashed")

    def _unary_body(self, method: str, request: Any) -> bytes:
        env = request.envelope
        if method == "Completion":
            return orjson.dumps(
                {
                    "id": "cmpl-" + env.request_id,
                    "object": "text_completion",
                    "created": 1,
                    "model": env.model,
                    "choices": [
                        {
                            "index": 0,
                            "text": f"hello from {self.proxy_id}",
                            "finish_reason": "stop",
                            "logprobs": None,
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                }
            )
        return orjson.dumps(
            {
                "id": "chatcmpl-" + env.request_id,
                "object": "chat.completion",
                "created": 1,
                "model": env.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": f"hello from {self.proxy_id}"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            }
        )

    def _chunk(self, method: str, request: Any, i: int) -> bytes:
        env = request.envelope
        if method == "CompletionStream":
            return orjson.dumps(
                {
                    "id": "cmpl-" + env.request_id,
                    "object": "text_completion",
                    "created": 1,
                    "model": env.model,
                    "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}],
                }
            )
        return orjson.dumps(
            {
                "id": "chatcmpl-" + env.request_id,
                "object": "chat.completion.chunk",
                "created": 1,
                "model": env.model,
                "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
            }
        )

    async def _unary(self, method: str, request: Any, context: Any) -> Any:
        fake = self._record(method, request, context)
        try:
            await self._check(fake, request, context)
            if fake.get("sleep"):
                await asyncio.sleep(fake["sleep"])
            return envelope_pb2.OpenAIResponse(body=self._unary_body(method, request))
        except asyncio.CancelledError:
            self.cancelled.append(request.envelope.request_id)
            raise

    async def _stream(self, method: str, request: Any, context: Any) -> Any:
        fake = self._record(method, request, context)
        rid = request.envelope.request_id
        try:
            await self._check(fake, request, context)
            n = int(fake.get("chunks", 3))
            for i in range(n):
                if i == n - 1 and fake.get("gate"):
                    deadline = time.monotonic() + 5
                    while not self.gate.is_set() and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    if not self.gate.is_set():
                        self.gate_timed_out.append(rid)
                if "error_after" in fake and i == fake["error_after"]:
                    await abort(
                        context, ServiceError(500, "engine died mid-stream", code="engine_error")
                    )
                self.produced.append((rid, i, time.monotonic()))
                yield envelope_pb2.StreamChunk(data=self._chunk(method, request, i))
                if fake.get("delay"):
                    await asyncio.sleep(fake["delay"])
            if fake.get("hang"):
                await asyncio.sleep(60)
        except asyncio.CancelledError:
            if rid not in self.cancelled:
                self.cancelled.append(rid)
            raise

    async def GetStats(self, request: Any, context: Any) -> Any:
        from areal_proto.proxy.v1 import proxy_pb2

        return proxy_pb2.ProxyStats(
            healthy=True, model=self.model, detail=f"FAKE proxy {self.proxy_id}"
        )

    async def ChatCompletion(self, request: Any, context: Any) -> Any:
        return await self._unary("ChatCompletion", request, context)

    async def GetSession(self, request: Any, context: Any) -> Any:
        """The status of a session in `statuses`; a session key only its own (the real proxy
        also checks the key's hash)."""
        from areal_proto.proxy.v1 import proxy_pb2

        md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        env = request.envelope
        self.received.append(
            Received("GetSession", env, request.session_id.encode(), md, context.time_remaining())
        )
        if not env.is_admin and env.session_id != request.session_id:
            await abort(
                context,
                ServiceError(403, "not its own session", code="forbidden_session"),
            )
        status = self.statuses.get(request.session_id)
        if status is None:
            await abort(
                context,
                ServiceError(
                    404, f"session '{request.session_id}' not found", code="session_not_found"
                ),
            )
        return proxy_pb2.GetSessionResponse(status=orjson.dumps(status))

    async def Completion(self, request: Any, context: Any) -> Any:
        return await self._unary("Completion", request, context)

    async def ExportTrajectories(self, request: Any, context: Any) -> Any:
        """The rows in `rows` of the sessions asked for, one chunk; the request is kept."""
        from areal_proto.proxy.v1 import proxy_pb2

        self.exports.append(request)
        rows = [r for sid in request.session_ids for r in self.rows.get(sid, [])]
        yield proxy_pb2.ExportChunk(
            jsonl=b"".join(orjson.dumps(r) + b"\n" for r in rows), rows=len(rows)
        )

    async def _stream_outer(self, method: str, request: Any, context: Any) -> Any:
        gen = self._stream(method, request, context)
        try:
            async for chunk in gen:
                yield chunk
        except asyncio.CancelledError:
            if request.envelope.request_id not in self.cancelled:
                self.cancelled.append(request.envelope.request_id)
            raise
        finally:
            await gen.aclose()

    async def ChatCompletionStream(self, request: Any, context: Any) -> Any:
        async for chunk in self._stream_outer("ChatCompletionStream", request, context):
            yield chunk

    async def CompletionStream(self, request: Any, context: Any) -> Any:
        async for chunk in self._stream_outer("CompletionStream", request, context):
            yield chunk


# --- FAKE OpenAI-compatible upstream (for external models) ------------------------------------

UPSTREAM_KEY = "upstream-secret-key-abcdef"


class FakeUpstream:
    def __init__(self) -> None:
        self.received: list[tuple[str, bytes, str]] = []
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )

    def _authorized(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {UPSTREAM_KEY}"

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "bad key", "type": "auth"}}, 401)
        return JSONResponse({"object": "list", "data": [{"id": "up-model", "object": "model"}]})

    async def _generate(self, request: Request, kind: str) -> Response:
        body = await request.body()
        self.received.append((request.url.path, body, request.headers.get("authorization", "")))
        if not self._authorized(request):
            return JSONResponse({"error": {"message": "bad key", "type": "auth"}}, 401)
        doc = orjson.loads(body)
        if doc.get("max_tokens") == 0:
            return JSONResponse(
                {"error": {"message": "max_tokens too small", "type": "invalid_request_error"}},
                400,
            )
        model = doc["model"]
        if doc.get("stream"):

            async def gen() -> Any:
                for i in range(3):
                    if kind == "chat":
                        chunk = {
                            "id": "up",
                            "object": "chat.completion.chunk",
                            "created": 1,
                            "model": model,
                            "choices": [
                                {"index": 0, "delta": {"content": f"u{i} "}, "finish_reason": None}
                            ],
                        }
                    else:
                        chunk = {
                            "id": "up",
                            "object": "text_completion",
                            "created": 1,
                            "model": model,
                            "choices": [{"index": 0, "text": f"u{i} ", "finish_reason": None}],
                        }
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                    await asyncio.sleep(0.01)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")
        if kind == "chat":
            return JSONResponse(
                {
                    "id": "up",
                    "object": "chat.completion",
                    "created": 1,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "from upstream"},
                            "finish_reason": "stop",
                        }
                    ],
                }
            )
        return JSONResponse(
            {
                "id": "up",
                "object": "text_completion",
                "created": 1,
                "model": model,
                "choices": [{"index": 0, "text": "from upstream", "finish_reason": "stop"}],
            }
        )

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")


async def start_http(app: Any) -> tuple[uvicorn.Server, int, asyncio.Task[None]]:
    """Serve a plain ASGI app on 127.0.0.1:<free port> in the running loop."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.005)
    return server, sock.getsockname()[1], task
