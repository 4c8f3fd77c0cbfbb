"""The OpenAI API through gateway -> router -> data proxy -> a real SGLang engine (CPU).

Clients: the official `openai` SDK (sync and async) and raw HTTP. The parrot
model repeats the last prompt token, so every answer is known exactly, and
the engine's own /generate on the same prompt ids is the reference for
tokens and logprobs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from stack import ADMIN_KEY, start_stack, wait_healthy, workers
from testpaths import PARROT
from tokenizers import Tokenizer

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("stack"), sglang_engine.url, PARROT, policy="least_loaded"
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(PARROT / "tokenizer.json"))


def chatml(messages):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def engine_generate(engine_url, ids, n, top=0):
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0},
        "return_logprob": True,
    }
    if top:
        body["top_logprobs_num"] = top
    out = httpx.post(engine_url + "/generate", json=body, timeout=60).json()
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def client(stack, **kw):
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, max_retries=0, **kw)


def aclient(stack):
    return openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, max_retries=0)


def test_models_list(stack):
    ids = [m.id for m in client(stack).models.list()]
    assert MODEL in ids


def test_chat_returns_exactly_the_engines_tokens(stack, sglang_engine, tok):
    msgs = [{"role": "user", "content": "Hi, give me a quick intro to AReaL."}]
    ids = tok.encode(chatml(msgs)).ids
    want_ids, want_lps = engine_generate(sglang_engine.url, ids, 6)
    r = client(stack).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    assert choice.message.content == tok.decode(want_ids, skip_special_tokens=False)
    assert choice.finish_reason == "length"
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(want_lps, abs=1e-5)
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6


async def test_async_stream_equals_non_stream(stack):
    c = aclient(stack)
    msgs = [{"role": "user", "content": "stream me"}]
    whole = await c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0
    )
    stream = await c.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish, n = [], None, None, 0
    async for chunk in stream:
        n += 1
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert n > 3, "tokens must arrive as separate chunks"
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    await c.close()


def test_completions_token_ids_match_generate(stack, sglang_engine, tok):
    ids = tok.encode("the answer is 42").ids
    want_ids, want_lps = engine_generate(sglang_engine.url, ids, 5)
    r = client(stack).completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=1
    )
    assert r.choices[0].text == tok.decode(want_ids, skip_special_tokens=False)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(want_lps, abs=1e-5)


def test_completions_text_stream_raw_sse(stack, tok):
    body = {
        "model": MODEL,
        "prompt": "hello world",
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        stack.gateway_url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    last = tok.encode("hello world").ids[-1]
    import json

    text = "".join(
        json.loads(e[6:])["choices"][0]["text"] for e in events[:-1] if json.loads(e[6:])["choices"]
    )
    assert text == tok.decode([last] * 4)


BAD = [
    ("malformed json", b"{not json", {}, 400),
    ("not an object", b"[1, 2]", {}, 400),
    ("missing messages", b'{"model": "tiny-parrot"}', {}, 400),
    (
        "unknown model",
        b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
        {},
        404,
    ),
    (
        "max_tokens < 1",
        b'{"model": "tiny-parrot", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}',
        {},
        400,
    ),
    (
        "unknown role",
        b'{"model": "tiny-parrot", "messages": [{"role": "wizard", "content": "x"}]}',
        {},
        400,
    ),
    ("wrong type", b'{"model": "tiny-parrot", "messages": "hello"}', {}, 400),
    (
        "n over 64",
        b'{"model": "tiny-parrot", "n": 65, "messages": [{"role": "user", "content": "x"}]}',
        {},
        400,
    ),
    (
        "unsupported parameter",
        b'{"model": "tiny-parrot", "audio": {}, "messages": [{"role": "user", "content": "x"}]}',
        {},
        400,
    ),
    (
        "missing key",
        b'{"model": "tiny-parrot", "messages": [{"role": "user", "content": "x"}]}',
        {"Authorization": ""},
        401,
    ),
    (
        "wrong key",
        b'{"model": "tiny-parrot", "messages": [{"role": "user", "content": "x"}]}',
        {"Authorization": "Bearer nope"},
        401,
    ),
]


@pytest.mark.parametrize(("case", "body", "headers", "status"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_openai_error(stack, case, body, headers, status):
    h = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json", **headers}
    h = {k: v for k, v in h.items() if v}
    r = httpx.post(stack.gateway_url + "/v1/chat/completions", content=body, headers=h, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    assert ok.choices[0].message.content is not None, "the service keeps serving after bad input"


def test_oversized_body_is_413(stack):
    big = (
        b'{"model": "tiny-parrot", "messages": [{"role": "user", "content": "'
        + b"x" * (9 << 20)
        + b'"}]}'
    )
    r = httpx.post(
        stack.gateway_url + "/v1/chat/completions",
        content=big,
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["message"]


async def test_least_loaded_spreads_concurrent_load(stack):
    c = aclient(stack)

    async def one():
        await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "load"}],
            max_tokens=400,
            temperature=0,
        )

    tasks = [asyncio.create_task(one()) for _ in range(8)]
    seen: dict[str, int] = {}
    for _ in range(100):
        await asyncio.sleep(0.05)
        for w in workers(stack):
            seen[w["proxy_id"]] = max(
                seen.get(w["proxy_id"], 0), int(w.get("inflight_requests", 0))
            )
        if len([v for v in seen.values() if v > 0]) == 2:
            break
    await asyncio.gather(*tasks)
    await c.close()
    busy = {k: v for k, v in seen.items() if v > 0}
    assert len(busy) == 2, f"least_loaded must use both replicas under concurrent load: {seen}"


async def test_client_disconnect_cancels_generation(stack):
    c = aclient(stack)
    stream = await c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "long"}],
        max_tokens=1500,
        temperature=0,
        stream=True,
    )
    async for _ in stream:
        break
    await stream.close()
    await c.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(int(w.get("inflight_requests", 0)) == 0 for w in workers(stack)):
            break
        await asyncio.sleep(0.1)
    assert all(int(w.get("inflight_requests", 0)) == 0 for w in workers(stack)), workers(stack)


def test_proxy_killed_under_traffic_fails_over(sglang_engine, tmp_path):
    s = start_stack(tmp_path / "failover", sglang_engine.url, PARROT, policy="round_robin")
    try:
        c = client(s, timeout=30)
        results: list[tuple[float, str]] = []
        stop = threading.Event()

        def traffic():
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=20
                    )
                    results.append((t0, "ok"))
                except openai.APIStatusError as e:
                    results.append((t0, f"{e.status_code}"))
                except openai.APIError as e:
                    results.append((t0, type(e).__name__))

        threads = [threading.Thread(target=traffic) for _ in range(3)]
        for t in threads:
            t.start()
        # One long in-flight request pinned to the victim must fail fast, not hang.
        victim = s.proxies[0]
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.killpg(victim.comp.pgid, signal.SIGKILL)
        time.sleep(4.0)
        stop.set()
        for t in threads:
            t.join(timeout=40)
        assert not any(t.is_alive() for t in threads), "a request hung after its proxy died"
        after = [r for t0, r in results if t0 > killed_at + 2.0]
        assert after and all(r == "ok" for r in after), (
            f"requests after detection must all succeed: {after}"
        )
        failed = [r for _, r in results if r != "ok"]
        assert all(r in ("502", "503") for r in failed), failed
        wait_healthy(s, MODEL, 1)
    finally:
        s.stop()


def test_cache_aware_keeps_a_prompt_prefix_on_one_replica(sglang_engine, tmp_path):
    """The gateway sends prefix hashes only to a cache_aware router; each conversation
    prefix then stays on the replica that served it first."""
    from stack import metric

    s = start_stack(tmp_path / "cache", sglang_engine.url, PARROT, policy="cache_aware")
    try:
        c = client(s)
        system = {"role": "system", "content": "You are a careful assistant. " * 8}
        counts = []
        for convo in range(4):
            before = [metric(p, "areal_proxy_requests_total") for p in s.proxies]
            for turn in range(3):
                msgs = [system, {"role": "user", "content": f"conversation {convo}"}]
                msgs += [{"role": "user", "content": f"turn {t}"} for t in range(turn)]
                c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
            after = [metric(p, "areal_proxy_requests_total") for p in s.proxies]
            counts.append([a - b for a, b in zip(after, before, strict=True)])
        # Every conversation's three turns went to one replica.
        assert all(sorted(c) == [0, 3] for c in counts), counts
    finally:
        s.stop()
