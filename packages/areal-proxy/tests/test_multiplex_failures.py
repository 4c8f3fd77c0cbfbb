"""A `Generate` stream's own tasks failing: a failure is seen, a cancellation propagates."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.serving.metrics import ProxyMetrics
from areal_proxy.serving.multiplex import GenerateStream


class _Context:
    """The servicer context of one call: only what GenerateStream uses without requests."""

    def __init__(self) -> None:
        self.written: list[Any] = []

    async def send_initial_metadata(self, _md: Any) -> None:
        return None

    async def write(self, message: Any) -> None:
        self.written.append(message)


class _Servicer:
    """The servicer of one call: only what GenerateStream reads without requests."""

    def __init__(self) -> None:
        self.metrics = ProxyMetrics()


async def test_a_failing_reader_is_logged_not_swallowed(caplog):
    async def frames():
        yield proxy_pb2.GenerateFrames()
        raise ValueError("reader bug")

    stream = GenerateStream(_Servicer(), _Context())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="areal_proxy.serving.multiplex"):
        await stream.run(frames())
    assert "reader bug" in caplog.text, "a bug in the reader ended the stream silently"


async def test_cancelling_the_call_while_it_winds_down_propagates():
    reading = asyncio.Event()

    async def frames():
        reading.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # a reader that takes a while to give up
            raise
        yield proxy_pb2.GenerateFrames()  # pragma: no cover

    stream = GenerateStream(_Servicer(), _Context())  # type: ignore[arg-type]
    task = asyncio.ensure_future(stream.run(frames()))
    await asyncio.wait_for(reading.wait(), 2)
    task.cancel()
    await asyncio.sleep(0.05)  # now winding down, waiting for the slow reader
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
