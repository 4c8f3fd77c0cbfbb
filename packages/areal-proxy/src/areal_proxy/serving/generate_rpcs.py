"""The generation RPCs of `InferenceProxyService`: chat and completions whole and streamed, the
multiplexed `Generate` stream, `CountTokens`, and `ContinueGeneration` (another replica's
request continued here). What a request means lives in inference/ and generation/; the
bookkeeping every generation shares is `ServicerBase.run_generation` (rpc_base.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.generation.migration import continue_steps
from areal_proxy.serving.multiplex import GenerateStream
from areal_proxy.serving.rpc_base import ServicerBase
from areal_runtime import tracing
from areal_runtime.errors import abort


class GenerateRpcs(ServicerBase, proxy_pb2_grpc.InferenceProxyServiceServicer):
    # The open `Generate` streams, and whether shutdown closed them (set by ProxyServicer).
    _streams: set[GenerateStream]
    _streams_closed: bool

    async def _unary(
        self,
        rpc: str,
        request: envelope_pb2.OpenAIRequest,
        context: Any,
        fn: Callable[[bytes, Any], Awaitable[tuple[bytes, GenerationRecord]]],
    ) -> envelope_pb2.OpenAIResponse:
        out: list[bytes] = []

        async def work() -> None:
            body, _ = await fn(request.body, request.envelope)
            out.append(body)

        err = await self.run_generation(rpc, request, context.time_remaining(), work)
        if err is not None:
            await abort(context, err)
        return envelope_pb2.OpenAIResponse(body=out[0])

    async def _stream(
        self,
        rpc: str,
        request: envelope_pb2.OpenAIRequest,
        context: Any,
        gen: Callable[[bytes, Any], AsyncGenerator[bytes, None]],
    ) -> None:
        async def work() -> None:
            async with aclosing(gen(request.body, request.envelope)) as chunks:
                async for data in chunks:
                    await context.write(envelope_pb2.StreamChunk(data=data))

        err = await self.run_generation(rpc, request, context.time_remaining(), work)
        if err is not None:
            await abort(context, err)

    async def ChatCompletion(self, request: Any, context: Any) -> envelope_pb2.OpenAIResponse:
        return await self._unary("ChatCompletion", request, context, self.handler.chat)

    async def ChatCompletionStream(self, request: Any, context: Any) -> None:  # type: ignore[override]
        await self._stream("ChatCompletionStream", request, context, self.handler.chat_stream)

    async def Completion(self, request: Any, context: Any) -> envelope_pb2.OpenAIResponse:
        return await self._unary("Completion", request, context, self.handler.completion)

    async def CompletionStream(self, request: Any, context: Any) -> None:  # type: ignore[override]
        await self._stream("CompletionStream", request, context, self.handler.completion_stream)

    async def Generate(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        stream = GenerateStream(self, context)
        self._streams.add(stream)
        if self._streams_closed:
            stream.close()
        try:
            await stream.run(request_iterator)
        finally:
            self._streams.discard(stream)

    async def CountTokens(self, request: Any, context: Any) -> proxy_pb2.CountTokensResponse:
        """A chat body's prompt size (inference/count.py): rendered and tokenized, nothing
        generated or recorded, so neither draining nor a paused engine holds it back."""
        try:
            n = await self.handler.count_tokens(request.body)
        except Exception as e:
            err = self._error(e)
            self._count("CountTokens", str(err.http_status))
            await abort(context, err)
            raise AssertionError("unreachable") from e
        self._count("CountTokens", "200")
        return proxy_pb2.CountTokensResponse(input_tokens=n)

    async def ContinueGeneration(self, request: Any, context: Any) -> None:  # type: ignore[override]
        """Another replica's request continued on this proxy's engine (migration.py)."""
        # The bookkeeping of every generation (draining refusal, deadline, metrics, errors)
        # reads an envelope: the call's id and deadline as one.
        env = envelope_pb2.OpenAIRequest(
            envelope=envelope_pb2.Envelope(
                request_id=request.rid,
                deadline_unix_ms=request.deadline_unix_ms,
                # The calling replica's engine span, from the call's metadata ({} when off).
                trace_context=tracing.metadata_carrier(context),
            )
        )

        async def work() -> None:
            steps = continue_steps(self.controller, request, self.state.proxy_id)
            async with aclosing(steps) as out:
                async for step in out:
                    await context.write(step)

        err = await self.run_generation("ContinueGeneration", env, context.time_remaining(), work)
        if err is not None:
            await abort(context, err)

    def held_results(self) -> int:
        """Results every `Generate` stream holds for callers that gave no credit (the
        metrics thread calls this when it scrapes; `tuple()` copies the set in one step)."""
        return sum(stream.held() for stream in tuple(self._streams))

    def close_streams(self) -> None:
        """Shutdown: every `Generate` stream stops reading and ends once its requests are done
        (a caller resends what it wrote after that point elsewhere: it was never read)."""
        self._streams_closed = True
        for stream in list(self._streams):
            stream.close()
