"""Checks every engine client passes against a real engine serving the parrot model.

test_sglang_engine.py and test_vllm_engine.py run them with their own client (and add
what only their engine does). The parrot repeats the last prompt token.
"""

from __future__ import annotations

import asyncio

import pytest

from areal_proxy.engine import GenerationRequest
from areal_proxy.engine.base import GenerationChunk, GenerationResult, collect


async def start_stream(client, req: GenerationRequest) -> tuple[asyncio.Task, list]:
    """Stream `req` in a task; return once the first chunk is in (with the chunk list)."""
    got: list[GenerationChunk] = []

    async def consume() -> None:
        async for c in client.generate_stream(req):
            got.append(c)

    task = asyncio.create_task(consume())
    while not got and not task.done():
        await asyncio.sleep(0.02)
    assert got, task.exception()
    return task, got


async def greedy_parrot_repeats_last_prompt_token(client, tok) -> None:
    ids = tok.encode("hello world").ids
    out = await client.generate(GenerationRequest(ids, max_new_tokens=6, temperature=0))
    assert out.token_ids == [ids[-1]] * 6
    assert out.finish_reason == "length"
    assert out.prompt_tokens == len(ids)


async def parrot_stops_at_end_token(client, tok) -> tuple[list[int], int]:
    """A prompt ending in <|im_end|> gets <|im_end|> and "stop"; returns (prompt, end id)."""
    end = tok.token_to_id("<|im_end|>")
    ids = [*tok.encode("hi there").ids, end]
    out = await client.generate(GenerationRequest(ids, max_new_tokens=8, temperature=0))
    assert out.token_ids == [end]
    assert out.finish_reason == "stop"
    return ids, end


async def logprob_for_every_output_token(client) -> GenerationResult:
    req = GenerationRequest([100, 200, 300], max_new_tokens=7, temperature=0, top_logprobs=3)
    out = await client.generate(req)
    assert len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs) == 7
    assert all(-1e-3 < lp <= 0 for lp in out.logprobs)  # the parrot is near-certain
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 3
        assert top[0] == (tok, pytest.approx(lp, abs=1e-6))
    return out


async def stream_yields_same_tokens_as_non_stream(
    client, tok, n: int
) -> tuple[GenerationResult, GenerationResult, list[int]]:
    """Returns (streamed, whole, prompt ids)."""
    ids = tok.encode("the answer is 42").ids
    req = GenerationRequest(ids, max_new_tokens=n, temperature=0)
    whole = await client.generate(req)
    chunks = [c async for c in client.generate_stream(req)]
    assert len(chunks) > 1, "streaming must deliver tokens incrementally"
    streamed = collect(chunks)
    assert streamed.token_ids == whole.token_ids
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert streamed.finish_reason == whole.finish_reason == "length"
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    return streamed, whole, ids


async def abort_by_rid_ends_stream_with_abort(client, n: int = 2000) -> None:
    req = GenerationRequest(
        [5, 6, 7], max_new_tokens=n, temperature=0, ignore_eos=True, rid="abort-me"
    )
    task, got = await start_stream(client, req)
    await client.abort("abort-me")
    await asyncio.wait_for(task, 30)
    out = collect(got)
    assert out.finish_reason == "abort"
    assert 0 < len(out.token_ids) < n
