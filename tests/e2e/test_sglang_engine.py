"""The project's SGLang client against a real engine on the CPU (parrot model)."""

from __future__ import annotations

import asyncio
import os
import time

import engine_checks as checks
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
    await checks.greedy_parrot_repeats_last_prompt_token(client, parrot_tokenizer)


async def test_parrot_stops_at_end_token(client, parrot_tokenizer):
    await checks.parrot_stops_at_end_token(client, parrot_tokenizer)


async def test_engine_rejection_is_an_error_not_an_empty_stream(client):
    from areal_proxy.engine import EngineError

    req = GenerationRequest([1, 2, 3], max_new_tokens=5000, temperature=0)
    with pytest.raises(EngineError, match="context length") as info:
        async for _ in client.generate_stream(req):
            pass
    assert info.value.status == 400


async def test_logprob_for_every_output_token(client):
    await checks.logprob_for_every_output_token(client)


async def test_stream_yields_same_tokens_as_non_stream(client, parrot_tokenizer):
    await checks.stream_yields_same_tokens_as_non_stream(client, parrot_tokenizer, 16)


async def test_abort_by_rid_ends_stream_with_abort(client):
    await checks.abort_by_rid_ends_stream_with_abort(client)


async def test_pause_aborts_in_flight_and_continue_resumes(client):
    req = GenerationRequest([5, 6, 8], max_new_tokens=2000, temperature=0, ignore_eos=True)
    task, got = await checks.start_stream(client, req)
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


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) that the live processes of group `pgid` have used."""
    ticks = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(rest[2]) == pgid:
            ticks += int(rest[11]) + int(rest[12])
    return ticks / os.sysconf("SC_CLK_TCK")


async def test_an_idle_engine_leaves_the_cpu_to_others(client, sglang_engine):
    # SGLang's scheduler polls its sockets in a busy loop unless --sleep-on-idle (in the CPU
    # flags areal starts it with): a whole core per idle engine, measured 1.02 cores.
    pgid = sglang_engine.component.pgid
    if not pgid:
        pytest.skip("an external engine (AREAL_TEST_SGLANG_URL): not areal's process group")
    assert await client.health()  # awake and serving, then left alone
    await asyncio.sleep(1.5)
    before, t0 = _group_cpu_s(pgid), time.monotonic()
    await asyncio.sleep(4.0)
    cores = (_group_cpu_s(pgid) - before) / (time.monotonic() - t0)
    assert cores < 0.25, f"the idle engine used {cores:.2f} of a core"
    assert await client.health()  # and wakes for the next request
