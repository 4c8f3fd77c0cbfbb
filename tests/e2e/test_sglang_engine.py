"""The project's SGLang client against a real engine on the CPU (parrot model)."""

from __future__ import annotations

import asyncio

import pytest

from areal_proxy.engine import GenerationRequest
from areal_proxy.engine.base import collect
from areal_proxy.engine.sglang import SGLangClient

pytestmark = pytest.mark.engine


@pytest.fixture
async def client(sglang_engine):
    c = SGLangClient(sglang_engine.url, timeout=60)
    yield c
    await c.close()


async def test_health(client):
    assert await client.health()


async def test_greedy_parrot_repeats_last_prompt_token(client, parrot_tokenizer):
    ids = parrot_tokenizer.encode("hello world").ids
    out = await client.generate(GenerationRequest(ids, max_new_tokens=6, temperature=0))
    assert out.token_ids == [ids[-1]] * 6
    assert out.finish_reason == "length"
    assert out.prompt_tokens == len(ids)


async def test_parrot_stops_at_end_token(client, parrot_tokenizer):
    end = parrot_tokenizer.token_to_id("<|im_end|>")
    ids = [*parrot_tokenizer.encode("hi there").ids, end]
    out = await client.generate(GenerationRequest(ids, max_new_tokens=8, temperature=0))
    assert out.token_ids == [end]
    assert out.finish_reason == "stop"


async def test_engine_rejection_is_an_error_not_an_empty_stream(client):
    from areal_proxy.engine import EngineError

    req = GenerationRequest([1, 2, 3], max_new_tokens=5000, temperature=0)
    with pytest.raises(EngineError, match="context length") as info:
        async for _ in client.generate_stream(req):
            pass
    assert info.value.status == 400


async def test_logprob_for_every_output_token(client):
    req = GenerationRequest([100, 200, 300], max_new_tokens=7, temperature=0, top_logprobs=3)
    out = await client.generate(req)
    assert len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs) == 7
    assert all(-1e-3 < lp <= 0 for lp in out.logprobs)  # the parrot is near-certain
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 3
        assert top[0] == (tok, pytest.approx(lp, abs=1e-6))


async def test_stream_yields_same_tokens_as_non_stream(client, parrot_tokenizer):
    ids = parrot_tokenizer.encode("the answer is 42").ids
    req = GenerationRequest(ids, max_new_tokens=16, temperature=0)
    whole = await client.generate(req)
    chunks = [c async for c in client.generate_stream(req)]
    assert len(chunks) > 1, "streaming must deliver tokens incrementally"
    streamed = collect(chunks)
    assert streamed.token_ids == whole.token_ids
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert streamed.finish_reason == whole.finish_reason == "length"
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])


async def test_abort_by_rid_ends_stream_with_abort(client):
    req = GenerationRequest(
        [5, 6, 7], max_new_tokens=2000, temperature=0, ignore_eos=True, rid="abort-me"
    )
    got = []

    async def consume():
        async for c in client.generate_stream(req):
            got.append(c)

    task = asyncio.create_task(consume())
    while not got and not task.done():
        await asyncio.sleep(0.02)
    assert got, task.exception()
    await client.abort("abort-me")
    await asyncio.wait_for(task, 30)
    out = collect(got)
    assert out.finish_reason == "abort"
    assert 0 < len(out.token_ids) < 2000


async def test_pause_aborts_in_flight_and_continue_resumes(client):
    req = GenerationRequest([5, 6, 8], max_new_tokens=2000, temperature=0, ignore_eos=True)
    got = []

    async def consume():
        async for c in client.generate_stream(req):
            got.append(c)

    task = asyncio.create_task(consume())
    while not got and not task.done():
        await asyncio.sleep(0.02)
    assert got, task.exception()
    await client.pause("abort")
    try:
        await asyncio.wait_for(task, 30)
        assert collect(got).finish_reason == "abort"
    finally:
        await client.resume()
    out = await client.generate(GenerationRequest([5, 6, 8], max_new_tokens=3, temperature=0))
    assert out.token_ids == [8, 8, 8]


async def test_update_weights_from_disk_swaps_behaviour(client, sglang_engine):
    from testpaths import PARROT, RANDOM

    ids = [100, 200, 300]
    req = GenerationRequest(ids, max_new_tokens=5, temperature=0)
    try:
        await client.update_weights_from_disk(str(RANDOM), version="1")
        out = await client.generate(req)
        assert out.weight_version == "1"
        assert out.token_ids != [300] * 5
    finally:
        await client.update_weights_from_disk(str(PARROT), version="0")
    out = await client.generate(req)
    assert out.token_ids == [300] * 5
    assert out.weight_version == "0"
    await client.flush_cache()
