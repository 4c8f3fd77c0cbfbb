"""EngineProgress's decisions on a fake clock: a health check that does not answer in time is
no verdict while the engine shows signs of life; silence past the stall timeout is; a check
answered with a failure is decisive at once."""

from __future__ import annotations

import pytest

from areal_proxy.engine.base import EngineError, GenerationChunk, GenerationRequest
from areal_proxy.engine.progress import EngineProgress, TrackedEngine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _progress(stall: float = 60.0) -> tuple[EngineProgress, Clock]:
    clock = Clock()
    return EngineProgress(stall, clock=clock), clock


def test_an_engine_never_seen_alive_gets_no_grace():
    p, _ = _progress()
    assert p.judge(None) == (False, False)
    assert p.judge(True) == (True, False)


def test_a_late_check_while_tokens_flow_is_busy_not_lost():
    p, clock = _progress(60.0)
    p.judge(True)
    p.begin()
    for _ in range(10):  # ten minutes of a slow engine that keeps producing
        clock.now += 59.0
        p.alive()
        assert p.judge(None) == (True, True)
    p.end()


def test_silence_past_the_stall_timeout_with_work_at_the_engine_is_a_stall():
    p, clock = _progress(60.0)
    p.judge(True)
    p.begin()
    clock.now += 59.0
    assert p.judge(None) == (True, True)
    clock.now += 2.0
    assert p.judge(None) == (False, False)
    assert "1 request(s) at the engine" in p.describe()
    # A token later: alive again.
    p.alive()
    assert p.judge(None) == (True, True)


def test_work_that_begins_on_an_idle_engine_starts_the_clock():
    p, clock = _progress(60.0)
    p.judge(True)
    clock.now += 3600.0  # idle for an hour, nothing owed
    p.begin()
    clock.now += 30.0
    assert p.judge(None) == (True, True)
    # A second request beside the first does not restart the clock.
    p.begin()
    clock.now += 31.0
    assert p.judge(None) == (False, False)


def test_an_idle_engine_whose_checks_stop_answering_stalls_too():
    p, clock = _progress(60.0)
    p.judge(True)
    clock.now += 30.0
    assert p.judge(None) == (True, True)
    clock.now += 31.0
    assert p.judge(None) == (False, False)


def test_a_failed_check_is_decisive_whatever_the_progress():
    p, _ = _progress(60.0)
    p.judge(True)
    p.begin()
    p.alive()
    assert p.judge(False) == (False, False)


class _Engine:
    base_url = "http://fake"

    def __init__(self, fail: EngineError | None = None) -> None:
        self.fail = fail
        self.flushed = 0

    async def health(self) -> bool | None:
        return True

    async def generate_stream(self, req: GenerationRequest):
        yield GenerationChunk([1], [0.0], [])
        if self.fail is not None:
            raise self.fail
        yield GenerationChunk([2], [0.0], [], finish_reason="stop")

    async def flush_cache(self) -> None:
        self.flushed += 1


async def test_the_tracked_engine_counts_requests_and_tokens_and_forwards_the_rest():
    p, clock = _progress(60.0)
    inner = _Engine()
    engine = TrackedEngine(inner, p)  # type: ignore[arg-type]
    seen = []
    async for _ in engine.generate_stream(GenerationRequest([5], 2)):
        seen.append(p.inflight)
        clock.now += 1.0
    assert seen == [1, 1] and p.inflight == 0
    assert p.silent_for() == 1.0  # the last chunk was the last sign of life
    await engine.flush_cache()  # not TrackedEngine's own: the wrapped client's
    assert inner.flushed == 1


async def test_a_lost_engine_is_no_sign_of_life():
    p, clock = _progress(60.0)
    engine = TrackedEngine(_Engine(EngineError("lost", status=503, lost=True)), p)  # type: ignore[arg-type]
    with pytest.raises(EngineError):
        async for _ in engine.generate_stream(GenerationRequest([5], 2)):
            clock.now += 5.0
    assert p.inflight == 0 and p.silent_for() == 5.0
