"""Agents used by the worker's tests (imported by path, like a user's agent)."""

from __future__ import annotations

import asyncio

CLOSED: list[str] = []


class Echo:
    async def run(self, request, *, emitter):
        return f"echo: {request.message_text}"


class Slow:
    """Emits a delta, then keeps working: the first event must arrive before the turn ends."""

    cancelled = asyncio.Event

    async def run(self, request, *, emitter):
        await emitter.delta("first ")
        call = await emitter.tool_call("lookup", {"q": request.message_text})
        await emitter.tool_result(call, {"answer": 42})
        await asyncio.sleep(float(request.metadata.get("sleep", 0.5)))
        await emitter.delta("last")
        return None

    async def close_session(self, session_id):
        CLOSED.append(session_id)


class Broken:
    async def run(self, request, *, emitter):
        await emitter.delta("partial")
        raise RuntimeError("tool backend down")


class NotAsync:
    def run(self, request, *, emitter):
        return "x"


class NoRun:
    pass
