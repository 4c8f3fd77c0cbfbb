"""The proxy's end of `Generate`: many generation requests over one long-lived gRPC stream.

A gRPC call costs a few hundred microseconds of CPU on each side in Python (call objects,
completion-queue round trips through grpc's poller thread, HTTP/2 stream set-up, the token
interceptor); a message on an open stream costs a small fraction of that. The gateway
therefore keeps one `Generate` stream per proxy and sends every chat/completion request on
it as a frame. Each request runs as its own task with exactly the bookkeeping of the
per-call RPCs (`ProxyServicer.run_generation`); its results are queued, and one writer
sends whatever is queued as one message. Nothing waits to be batched: a frame goes out as
soon as the previous write finished, so batching only happens when frames pile up anyway.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from areal_proto.proxy.v1 import proxy_pb2
from areal_runtime.batching import take_batch
from areal_runtime.errors import InvalidRequest, ServiceError

if TYPE_CHECKING:
    from areal_proxy.service import ProxyServicer

log = logging.getLogger(__name__)

_CHAT = proxy_pb2.GENERATE_KIND_CHAT
_COMPLETION = proxy_pb2.GENERATE_KIND_COMPLETION

# The per-call RPC each (kind, stream) stands for: its name labels the same metrics.
_RPC_NAMES = {
    (_CHAT, False): "ChatCompletion",
    (_CHAT, True): "ChatCompletionStream",
    (_COMPLETION, False): "Completion",
    (_COMPLETION, True): "CompletionStream",
}


class GenerateStream:
    """One open `Generate` call: its request tasks and its single writer."""

    def __init__(self, servicer: ProxyServicer, context: Any) -> None:
        self.servicer = servicer
        self.context = context
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self._out: list[proxy_pb2.GenerateResult] = []
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._finished = False

    def close(self) -> None:
        """Stop reading new frames; the call ends once its running requests are done."""
        self._closing.set()

    # -- the call --

    async def run(self, frames: AsyncIterator[proxy_pb2.GenerateFrames]) -> None:
        # The caller waits for this before sending work: the stream reached a live proxy.
        await self.context.send_initial_metadata(())
        writer = asyncio.ensure_future(self._write_loop())
        reader = asyncio.ensure_future(self._read_loop(frames))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((reader, closing), return_when=asyncio.FIRST_COMPLETED)
            # The caller closed its side (or we are shutting down): finish what runs.
            reader.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            # The writer sends what is left, then ends the call.
            self._finished = True
            self._wake.set()
            await writer
        finally:
            # Cancelled (the caller or the transport went away, or the server stopped): every
            # request still running is cancelled too, which aborts its engine request.
            for task in (reader, closing, writer, *self.tasks.values()):
                task.cancel()
            # Wait for both to end without raising what they raised: their cancellation is
            # expected, anything else is a failure to see (a bug in the reader used to end
            # the stream as if the caller had closed it, silently). A cancellation of this
            # call while it waits here still propagates (asyncio.wait does not swallow it).
            await asyncio.wait((reader, writer))
            for name, task in (("reader", reader), ("writer", writer)):
                if not task.cancelled() and (exc := task.exception()) is not None:
                    log.warning("Generate stream %s failed: %r", name, exc, exc_info=exc)

    async def _read_loop(self, frames: AsyncIterator[proxy_pb2.GenerateFrames]) -> None:
        async for message in frames:
            for frame in message.frames:
                if frame.cancel:
                    task = self.tasks.get(frame.id)
                    if task is not None:
                        task.cancel()
                elif frame.id in self.tasks:
                    self._emit_error(
                        frame.id,
                        InvalidRequest(f"request id {frame.id} is already in use"),
                    )
                else:
                    task = asyncio.ensure_future(self._serve(frame))
                    self.tasks[frame.id] = task
                    task.add_done_callback(functools.partial(self._forget, frame.id))

    # -- one request --

    def _forget(self, rid: int, _task: asyncio.Task[None]) -> None:
        self.tasks.pop(rid, None)

    async def _serve(self, frame: proxy_pb2.GenerateFrame) -> None:
        rid = frame.id
        request = frame.request
        stream = request.envelope.stream
        rpc = _RPC_NAMES.get((frame.kind, stream))
        if rpc is None:
            self._emit_error(rid, InvalidRequest(f"unknown generation kind {frame.kind}"))
            return
        handler = self.servicer.handler
        work: Callable[[], Awaitable[None]]
        if stream:
            gen: Callable[[bytes, Any], AsyncGenerator[bytes, None]] = (
                handler.chat_stream if frame.kind == _CHAT else handler.completion_stream
            )

            async def work() -> None:
                async with aclosing(gen(request.body, request.envelope)) as chunks:
                    async for data in chunks:
                        self._emit(proxy_pb2.GenerateResult(id=rid, data=data))

        else:
            fn = handler.chat if frame.kind == _CHAT else handler.completion

            async def work() -> None:
                body, _ = await fn(request.body, request.envelope)
                self._emit(proxy_pb2.GenerateResult(id=rid, data=body, done=True))

        try:
            err = await self.servicer.run_generation(rpc, request, None, work)
        except asyncio.CancelledError:
            return  # the caller cancelled this id: it expects nothing more for it
        if err is not None:
            self._emit_error(rid, err)
        elif stream:
            self._emit(proxy_pb2.GenerateResult(id=rid, done=True))

    # -- writing --

    def _emit_error(self, rid: int, err: ServiceError) -> None:
        self._emit(proxy_pb2.GenerateResult(id=rid, done=True, error=err.detail()))

    def _emit(self, result: proxy_pb2.GenerateResult) -> None:
        self._out.append(result)
        self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._out:
                batch, self._out = take_batch(self._out, _result_size)
                await self.context.write(proxy_pb2.GenerateResults(results=batch))
            if self._finished:
                return


def _result_size(result: proxy_pb2.GenerateResult) -> int:
    return len(result.data)
