"""Another replica's proxy as an engine: a migrated request continues there.

`PeerEngine` speaks the engine-client protocol over the peer's
`InferenceProxyService.ContinueGeneration`, so the generation loop treats it as it treats its
own engine; its chunks carry the peer's proxy id (`replica`) and the weight version the peer
generated them with (`weight_version`). The only module that touches that RPC's stub (and the
sampling JSON both sides read).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Any

import grpc
import orjson

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proxy.engine.base import (
    EngineError,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    collect,
)
from areal_runtime import tracing
from areal_runtime.auth import call_metadata
from areal_runtime.errors import InvalidRequest, from_rpc_error

# The loop time by which the client's request must be done (set by the servicer around a
# generation): a continuation on a peer is bounded by it, so the peer stops generating when
# nobody waits any more. None: no deadline known here (the peer's own timeout holds).
REQUEST_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "areal_request_deadline", default=None
)

# What a peer's failure with these codes means: its engine was lost too (it never migrates a
# continuation again), or it drains. Either way the next peer may continue the request.
_LOST_CODES = frozenset({"engine_lost", "draining"})

# A restarted peer at the same address must be reachable again quickly (gRPC's default
# reconnect back-off grows to 120 s); the messages are those of a long generation.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)

# GenerationRequest fields that travel outside the sampling JSON (or not at all).
_NOT_SAMPLING = frozenset({"input_ids", "input_ids_json", "rid", "max_new_tokens", "top_logprobs"})
_SAMPLING = frozenset(f.name for f in fields(GenerationRequest)) - _NOT_SAMPLING


def sampling_json(req: GenerationRequest) -> bytes:
    """The request's sampling parameters, as a continuation on a peer must use them."""
    return orjson.dumps({name: getattr(req, name) for name in sorted(_SAMPLING)})


def request_from(msg: proxy_pb2.ContinueGenerationRequest) -> GenerationRequest:
    """The engine request a ContinueGeneration call asks for; a sampling field this proxy does
    not know is refused (sampled otherwise, the continuation would not be the request's)."""
    if not msg.input_ids:
        raise InvalidRequest("input_ids is required", param="input_ids")
    if msg.max_new_tokens <= 0:
        raise InvalidRequest("max_new_tokens must be > 0", param="max_new_tokens")
    try:
        raw = orjson.loads(msg.sampling) if msg.sampling else {}
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"sampling is not JSON: {e}", param="sampling") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("sampling must be a JSON object", param="sampling")
    unknown = sorted(set(raw) - _SAMPLING)
    if unknown:
        raise InvalidRequest(f"unknown sampling fields: {', '.join(unknown)}", param="sampling")
    constraint = raw.get("constraint")
    if constraint is not None:
        if not (isinstance(constraint, list) and len(constraint) == 2):
            raise InvalidRequest("constraint must be [kind, value]", param="sampling")
        raw["constraint"] = (str(constraint[0]), str(constraint[1]))
    try:
        return GenerationRequest(
            input_ids=list(msg.input_ids),
            max_new_tokens=int(msg.max_new_tokens),
            top_logprobs=max(0, int(msg.top_logprobs)),
            **raw,
        )
    except TypeError as e:
        raise InvalidRequest(f"bad sampling: {e}", param="sampling") from None


def _deadline_unix_ms() -> tuple[int, float | None]:
    """The request's deadline as unix ms (0 = none) and as seconds left."""
    deadline = REQUEST_DEADLINE.get()
    if deadline is None:
        return 0, None
    left = deadline - asyncio.get_running_loop().time()
    return int((time.time() + left) * 1000), max(left, 0.001)


class PeerEngine:
    """One peer proxy (by proxy id and address) as an engine client."""

    def __init__(self, proxy_id: str, address: str, channel: grpc.aio.Channel) -> None:
        self.proxy_id = proxy_id
        self.address = address
        self.base_url = f"grpc://{address}"
        self._stub = proxy_pb2_grpc.InferenceProxyServiceStub(channel)
        self._calls: dict[str, Any] = {}
        self._aborted: set[str] = set()

    def _error(self, exc: grpc.RpcError) -> EngineError:
        """The peer's failure as the engine error the generation loop reads: `lost` when the
        peer could not be reached, went away, or lost its own engine (the next peer may
        continue); otherwise its answer about the request, which fails it."""
        err = from_rpc_error(exc, target=f"peer proxy {self.proxy_id} ({self.address})")
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        has_detail = any(k == "areal-error-bin" for k, _ in exc.trailing_metadata() or ())
        lost = (err.code in _LOST_CODES) or (
            not has_detail and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        )
        # Without a detail, from_rpc_error's message names the peer already.
        message = f"peer proxy {self.proxy_id}: {err.message}" if has_detail else err.message
        return EngineError(message, status=err.http_status, lost=lost)

    async def health(self) -> bool:
        return True  # the router's view of it decided that it was asked

    async def close(self) -> None:
        for call in list(self._calls.values()):
            call.cancel()

    async def abort(self, rid: str | None = None) -> None:
        """Cancel the call carrying engine request `rid` (the peer then aborts its engine's)."""
        targets = [rid] if rid else list(self._calls)
        for r in targets:
            call = self._calls.get(r) if r else None
            if call is not None:
                self._aborted.add(r)  # type: ignore[arg-type]
                call.cancel()

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        chunks = [c async for c in self.generate_stream(req)]
        res = collect(chunks)
        res.replica = self.proxy_id
        return res

    async def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        deadline_ms, left = _deadline_unix_ms()
        msg = proxy_pb2.ContinueGenerationRequest(
            input_ids=req.input_ids,
            max_new_tokens=req.max_new_tokens,
            sampling=sampling_json(req),
            rid=req.rid or "",
            deadline_unix_ms=deadline_ms,
            top_logprobs=req.top_logprobs,
        )
        md = tracing.metadata(call_metadata())
        call = self._stub.ContinueGeneration(msg, metadata=md, timeout=left)
        rid = req.rid or ""
        if rid:
            self._calls[rid] = call
        try:
            while True:
                try:
                    step = await call.read()
                except grpc.RpcError as exc:
                    raise self._error(exc) from None
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if rid in self._aborted and task is not None and not task.cancelling():
                        yield GenerationChunk([], [], [], "abort", replica=self.proxy_id)
                        return
                    raise
                if step is grpc.aio.EOF:
                    break
                tops = [[(e.token_id, e.logprob) for e in t.entries] for t in step.top_logprobs]
                yield GenerationChunk(
                    token_ids=list(step.token_ids),
                    logprobs=list(step.logprobs),
                    top_logprobs=tops,
                    finish_reason=step.finish_reason or None,
                    matched_stop=step.matched_stop if step.has_matched_stop else None,
                    prompt_tokens=len(req.input_ids),
                    weight_version=str(step.version),
                    replica=step.replica or self.proxy_id,
                )
                if step.finish_reason:
                    return
        finally:
            self._calls.pop(rid, None)
            self._aborted.discard(rid)
            call.cancel()
        raise EngineError(
            f"peer proxy {self.proxy_id} ended its stream without a finish reason",
            status=502,
            lost=True,
        )
