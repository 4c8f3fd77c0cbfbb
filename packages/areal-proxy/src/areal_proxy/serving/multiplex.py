"""The proxy's end of `Generate`: many generation requests over one long-lived gRPC stream.

A gRPC call costs a few hundred microseconds of CPU on each side in Python (call objects,
completion-queue round trips through grpc's poller thread, HTTP/2 stream set-up, the token
interceptor); a message on an open stream costs a small fraction of that. The gateway
therefore keeps one `Generate` stream per proxy and sends every chat/completion request on
it as a frame. Each request runs as its own task with exactly the bookkeeping of the
per-call RPCs (`ServicerBase.run_generation`); its results are queued, and one writer
sends whatever is queued as one message. A result after a quiet spell goes out at once; while
results keep coming for several requests, the writer sends at most one message per
`COALESCE_S` (2 ms), carrying every request's results that became ready in that window.

Flow control is per request (the HTTP/2 window is the whole stream's, so it would let one
slow client stall every request on it). A request's frame says how many of its results the
caller buffers (`window`); the caller returns credits as its client consumes them. Results
without credit wait in that request's own queue, and when `QUEUE_LIMIT` of them wait, the
request's task waits too: it stops reading its engine stream. What this bounds is areal's
memory for the request; the engine decides for itself what it does with output nobody reads
(SGLang 0.5 keeps generating and holds the output in its own process, then sends it coalesced
when the proxy reads again). A client that stops reading entirely holds its request until it
reads again, cancels, or its deadline passes.

Two metrics show it: `areal_proxy_stream_held_results` (results queued for requests whose
caller gave no credit, all streams together; read when scraped) and
`areal_proxy_stream_credit_waits_total` (times a request's task waited for room in its queue:
mostly for credit, sometimes only because the stream's writer is behind).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from areal_proto.proxy.v1 import proxy_pb2
from areal_runtime.batching import take_batch
from areal_runtime.errors import InvalidRequest, ServiceError

if TYPE_CHECKING:
    from areal_proxy.serving.rpc_base import ServicerBase

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


# Results of one request the proxy holds while the caller has given no credit for them;
# at this many the request's task waits (and so stops reading its engine stream).
QUEUE_LIMIT = 16

# The writer sends at most one message per this many seconds while results keep coming
# (each waits at most this long): a GPU engine's streams each yield a token every ~20-50 ms,
# so at hundreds of streams a message per token cost more CPU on both ends than the tokens.
COALESCE_S = 0.002


class _Flow:
    """One request's results on their way out, and the credit the caller gave for them."""

    __slots__ = ("credit", "listed", "queue", "space")

    def __init__(self, window: int) -> None:
        self.queue: deque[proxy_pb2.GenerateResult] = deque()
        # Results the proxy may still send; -1: no limit (a caller that sets no window).
        self.credit = window if window > 0 else -1
        # Queued in the stream's ready list (results and credit both present).
        self.listed = False
        # Set while the request's task waits for room in the queue.
        self.space: asyncio.Future[None] | None = None

    def sendable(self) -> bool:
        return bool(self.queue) and self.credit != 0

    def wake(self) -> None:
        if self.space is not None and not self.space.done():
            self.space.set_result(None)


class GenerateStream:
    """One open `Generate` call: its request tasks and its single writer."""

    def __init__(self, servicer: ServicerBase, context: Any) -> None:
        self.servicer = servicer
        self.context = context
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.flows: dict[int, _Flow] = {}
        # Flows with results and credit, in the order they became so (the writer's turn).
        self._ready: deque[_Flow] = deque()
        # Results to write now: taken from ready flows, or errors outside any flow.
        self._out: list[proxy_pb2.GenerateResult] = []
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._finished = False
        self._credit_waits = servicer.metrics.stream_credit_waits

    def close(self) -> None:
        """Stop reading new frames; the call ends once its running requests are done."""
        self._closing.set()

    def _unmeter(self) -> None:
        """No frame is read any more, so no credit can arrive: the requests still running
        send what they produce without one (for as long as the drain lasts, --drain-timeout;
        a caller that half-closed its side reads to the end anyway)."""
        for flow in self.flows.values():
            flow.credit = -1
            self._list(flow)

    def backlog(self) -> int:
        """The most results any one request holds here (bounded by QUEUE_LIMIT + 1)."""
        return max((len(f.queue) for f in self.flows.values()), default=0)

    def held(self) -> int:
        """Results queued for requests whose caller has given no credit for them.

        Called by the metrics thread when it scrapes: `tuple()` copies the flows in one step
        (under the GIL), and each flow's fields are read once."""
        return sum(len(f.queue) for f in tuple(self.flows.values()) if f.credit == 0)

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
            self._unmeter()
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
                    self._drop(frame.id)
                elif frame.credit:
                    self._grant(frame.id, frame.credit)
                elif frame.id in self.tasks or frame.id in self.flows:
                    self._emit_error(
                        frame.id,
                        InvalidRequest(f"request id {frame.id} is already in use"),
                    )
                else:
                    flow = self.flows[frame.id] = _Flow(frame.window)
                    task = asyncio.ensure_future(self._serve(frame, flow))
                    self.tasks[frame.id] = task
                    task.add_done_callback(functools.partial(self._forget, frame.id))

    # -- one request --

    def _forget(self, rid: int, _task: asyncio.Task[None]) -> None:
        self.tasks.pop(rid, None)

    async def _serve(self, frame: proxy_pb2.GenerateFrame, flow: _Flow) -> None:
        rid = frame.id
        request = frame.request
        stream = request.envelope.stream
        rpc = _RPC_NAMES.get((frame.kind, stream))
        if rpc is None:
            self._finish(flow, _error_result(rid, InvalidRequest(f"unknown kind {frame.kind}")))
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
                        # Waits while the request's queue is full: the next chunk (and the
                        # engine read behind it) waits for the caller's client.
                        await self._put(flow, proxy_pb2.GenerateResult(id=rid, data=data))

        else:
            fn = handler.chat if frame.kind == _CHAT else handler.completion

            async def work() -> None:
                body, _ = await fn(request.body, request.envelope)
                self._finish(flow, proxy_pb2.GenerateResult(id=rid, data=body, done=True))

        try:
            err = await self.servicer.run_generation(rpc, request, None, work)
        except asyncio.CancelledError:
            self._drop(rid)
            return  # the caller cancelled this id: it expects nothing more for it
        if err is not None:
            self._finish(flow, _error_result(rid, err))
        elif stream:
            self._finish(flow, proxy_pb2.GenerateResult(id=rid, done=True))

    # -- writing --

    def _emit_error(self, rid: int, err: ServiceError) -> None:
        """An answer to a frame that started no request (it has no flow of its own)."""
        self._out.append(_error_result(rid, err))
        self._wake.set()

    async def _put(self, flow: _Flow, result: proxy_pb2.GenerateResult) -> None:
        if len(flow.queue) >= QUEUE_LIMIT:
            self._credit_waits.inc()
        while len(flow.queue) >= QUEUE_LIMIT:
            flow.space = asyncio.get_running_loop().create_future()
            try:
                await flow.space
            finally:
                flow.space = None
        flow.queue.append(result)
        self._list(flow)

    def _finish(self, flow: _Flow, result: proxy_pb2.GenerateResult) -> None:
        """The request's last result: queued without waiting (one more than the limit)."""
        flow.queue.append(result)
        self._list(flow)

    def _list(self, flow: _Flow) -> None:
        if not flow.listed and flow.sendable():
            flow.listed = True
            self._ready.append(flow)
            self._wake.set()

    def _grant(self, rid: int, credit: int) -> None:
        flow = self.flows.get(rid)
        if flow is not None and flow.credit >= 0:
            flow.credit += credit
            self._list(flow)

    def _drop(self, rid: int) -> None:
        """The caller gave up on `rid`: nothing more of it is sent."""
        flow = self.flows.pop(rid, None)
        if flow is not None:
            flow.queue.clear()
            flow.wake()

    def _take_ready(self) -> None:
        """Move every result that has credit to the write queue, one flow after another."""
        ready, out = self._ready, self._out
        while ready:
            flow = ready.popleft()
            flow.listed = False
            queue = flow.queue
            n = len(queue) if flow.credit < 0 else min(flow.credit, len(queue))
            if flow.credit > 0:
                flow.credit -= n
            for _ in range(n):
                result = queue.popleft()
                out.append(result)
                if result.done:
                    self.flows.pop(result.id, None)
            flow.wake()

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = -COALESCE_S
        while True:
            await self._wake.wait()
            # A message within COALESCE_S of the previous one waits out the rest of that
            # window, so that what becomes ready meanwhile (every other request's next token)
            # goes with it: one message a window instead of one per token. The first result
            # after a quiet spell goes at once, and a lone request never waits (there is
            # nothing to send with it).
            wait = last + COALESCE_S - loop.time()
            if wait > 0 and len(self.flows) > 1 and not self._finished:
                await asyncio.sleep(wait)
            self._wake.clear()
            self._take_ready()
            while self._out:
                batch, self._out = take_batch(self._out, _result_size)
                await self.context.write(proxy_pb2.GenerateResults(results=batch))
            last = loop.time()
            if self._finished and not self.flows:
                return


def _error_result(rid: int, err: ServiceError) -> proxy_pb2.GenerateResult:
    return proxy_pb2.GenerateResult(id=rid, done=True, error=err.detail())


def _result_size(result: proxy_pb2.GenerateResult) -> int:
    return len(result.data)
