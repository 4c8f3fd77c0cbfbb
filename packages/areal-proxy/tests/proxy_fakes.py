"""Test doubles for the areal-proxy unit tests: FakeEngineClient (an in-process stand-in for
SGLang, not an engine) and a harness that runs the real gRPC server in front of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson

from areal_proto.common.v1 import envelope_pb2
from areal_proto.common.v1.envelope_pb2 import ErrorDetail
from areal_proto.proxy.v1 import proxy_pb2_grpc
from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.engine.base import (
    EngineError,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    collect,
)
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.server import ProxyServer, create_server
from areal_proxy.settings import Settings

PARROT = Path(__file__).resolve().parents[3] / "models" / "tiny-parrot"
EOS = 2


def lp_of(token: int) -> float:
    return -0.001 * (token + 1)


class FakeEngineClient:
    """Plays back a fixed output `sequence`, one token per chunk, like a deterministic model.

    A resubmitted request (prompt + k tokens already produced) continues at sequence[k].
    pause(mode="abort") ends every running generation with finish "abort" and holds new
    ones until resume(), as SGLang does. It ignores `stop` strings (the proxy must cope).
    """

    base_url = "http://fake-engine"

    def __init__(
        self,
        sequence: list[int],
        *,
        delay: float = 0.0,
        fail: EngineError | None = None,
        fail_update: EngineError | None = None,
    ) -> None:
        self.sequence = sequence
        self.delay = delay
        self.fail = fail
        self.fail_update = fail_update
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str | None] = []
        self.updates: list[tuple[str, str | None]] = []
        self.pause_calls = 0
        self.resume_calls = 0
        self.healthy = True
        self.closed = False
        self.tokens_sent = 0
        self._paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._abort_all = 0
        self._aborted_rids: set[str] = set()
        self._prompt_len: int | None = None

    async def health(self) -> bool:
        return self.healthy

    async def close(self) -> None:
        self.closed = True

    async def abort(self, rid: str | None = None) -> None:
        self.aborted.append(rid)
        if rid:
            self._aborted_rids.add(rid)
        else:
            self._abort_all += 1

    async def pause(self, mode: str = "abort") -> None:
        self.pause_calls += 1
        self._paused = True
        self._unpaused.clear()
        self._abort_all += 1

    async def resume(self) -> None:
        self.resume_calls += 1
        self._paused = False
        self._unpaused.set()

    async def update_weights_from_disk(self, path: str, version: str | None = None) -> None:
        if self.fail_update is not None:
            raise self.fail_update
        self.updates.append((path, version))

    async def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(req)
        if self.fail is not None:
            raise self.fail
        await self._unpaused.wait()
        if self._prompt_len is None:
            self._prompt_len = len(req.input_ids)
        k = len(req.input_ids) - self._prompt_len
        abort_epoch = self._abort_all
        produced = 0
        for token in self.sequence[k:]:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self._abort_all != abort_epoch or req.rid in self._aborted_rids:
                yield self._chunk([], req, "abort")
                return
            produced += 1
            self.tokens_sent += 1
            stop = token in req.stop_token_ids and not req.ignore_eos
            finish = "stop" if stop else ("length" if produced >= req.max_new_tokens else None)
            yield self._chunk([token], req, finish, token if stop else None)
            if finish:
                return
        yield self._chunk([], req, "length")

    def _chunk(
        self, ids: list[int], req: GenerationRequest, finish: str | None, matched: int | None = None
    ) -> GenerationChunk:
        tops = [[(t, lp_of(t)), (t + 1, lp_of(t) - 1.0)][: req.top_logprobs] for t in ids]
        return GenerationChunk(
            token_ids=ids,
            logprobs=[lp_of(t) for t in ids],
            top_logprobs=tops if req.top_logprobs else [],
            finish_reason=finish,
            matched_stop=matched,
            prompt_tokens=len(req.input_ids),
        )

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        chunks = [c async for c in self.generate_stream(req)]
        return collect(chunks)


@dataclass
class Harness:
    """The real ProxyServer (gRPC on loopback) in front of a FakeEngineClient."""

    server: ProxyServer
    engine: FakeEngineClient
    channel: grpc.aio.Channel
    stub: proxy_pb2_grpc.InferenceProxyServiceStub
    status: proxy_pb2_grpc.ProxyStatusServiceStub
    records: list[GenerationRecord] = field(default_factory=list)

    @property
    def tok(self) -> ModelTokenizer:
        return self.server.tokenizer

    async def chat(self, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        r = await self.stub.ChatCompletion(request(body, **kw))
        return orjson.loads(r.body)

    async def chat_stream(self, body: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
        return [
            orjson.loads(c.data) async for c in self.stub.ChatCompletionStream(request(body, **kw))
        ]

    async def completion(self, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        r = await self.stub.Completion(request(body, **kw))
        return orjson.loads(r.body)

    async def completion_stream(self, body: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
        return [orjson.loads(c.data) async for c in self.stub.CompletionStream(request(body, **kw))]

    async def close(self) -> None:
        await self.channel.close()
        await self.server.shutdown()


def request(
    body: dict[str, Any] | bytes,
    *,
    deadline_ms: int = 0,
    request_id: str = "t",
    api_key: str = "",
    session_id: str = "",
    is_admin: bool = False,
    call_kind: str = "",
) -> envelope_pb2.OpenAIRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    env = envelope_pb2.Envelope(
        request_id=request_id,
        deadline_unix_ms=deadline_ms,
        api_key=api_key,
        session_id=session_id,
        is_admin=is_admin,
        call_kind=call_kind,
    )
    return envelope_pb2.OpenAIRequest(envelope=env, body=raw)


def settings(**over: Any) -> Settings:
    base: dict[str, Any] = {
        "engine_url": "http://fake-engine",
        "model": "tiny-parrot",
        "tokenizer_path": str(PARROT),
        "metrics_port": -1,
        "drain_timeout": 2.0,
        "engine_health_interval": 60.0,
        "db_path": ":memory:",
    }
    base.update(over)
    return Settings(**base)


async def start(engine: FakeEngineClient, **over: Any) -> Harness:
    server = create_server(settings(**over), engine=engine)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    h = Harness(
        server,
        engine,
        channel,
        proxy_pb2_grpc.InferenceProxyServiceStub(channel),
        proxy_pb2_grpc.ProxyStatusServiceStub(channel),
    )
    observe = server.controller.on_finish

    def record(rec: GenerationRecord) -> None:
        h.records.append(rec)
        if observe is not None:
            observe(rec)

    server.controller.on_finish = record
    return h


def error_detail(exc: grpc.aio.AioRpcError) -> ErrorDetail:
    for key, value in exc.trailing_metadata() or ():
        if key == "areal-error-bin":
            return ErrorDetail.FromString(value)
    raise AssertionError(f"no areal-error-bin in {exc!r}")


async def wait_for(cond: Any, within: float = 2.0) -> None:
    end = time.monotonic() + within
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
