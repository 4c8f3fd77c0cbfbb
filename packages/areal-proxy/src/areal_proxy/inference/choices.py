"""Several choices of one request (`n`, a list of prompts): generated together, their stream
chunks merged in the order they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Iterable
from contextlib import aclosing


async def all_of(coros: Iterable[Awaitable[None]]) -> None:
    """Await every coroutine; on the first failure cancel the others, then raise it."""
    pending = list(coros)
    if len(pending) == 1:  # the usual case (n=1): no task, no extra turn of the loop
        await pending[0]
        return
    tasks = [asyncio.ensure_future(c) for c in pending]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: list[AsyncGenerator[bytes, None]]) -> AsyncGenerator[bytes, None]:
    """The chunks of every choice's stream, in the order they are produced."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for chunk in only:
                yield chunk
        return
    # Bounded: a slow reader holds back every choice's stream (and through it the engine's
    # credit), as it does a single choice's.
    queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue(maxsize=2 * len(streams))

    async def pump(stream: AsyncGenerator[bytes, None]) -> None:
        try:
            async with aclosing(stream) as s:
                async for chunk in s:
                    await queue.put(chunk)
        except Exception as e:  # handed to the consumer, which raises it (cancellation is not)
            await queue.put(e)
            return
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
