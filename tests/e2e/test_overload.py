"""Overload is back-pressure, and a busy engine is not a dead one, on the real CPU engine.

One replica of tiny-parrot (the session's SGLang engine) behind a router, a gateway and one
data proxy whose bound is low (`AREAL_PROXY_MAX_INFLIGHT`, as an operator would set it).
First a flood: 48 clients send chats back to back for 20 s, within the bound (the engine
queues them); then a burst of 160 at once, far past it. Throughout, the router's view of the
proxy and the proxy's view of its engine are sampled. Then:

* no answer is a 5xx (a flood of this kind once ended in 503 `migration_failed` for every
  request, then 503 `no_healthy_proxy`);
* every refusal is a 429 `overloaded` (`rate_limit_error`) with a `Retry-After`, and the
  burst got some (none at all before: nothing bounded what a replica took);
* the proxy stayed HEALTHY at the router and its engine healthy at the proxy the whole time;
* the engine is the process it was (nothing restarted it), and a chat after the flood answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from stack import ADMIN_KEY, Stack, metric, start_stack, workers
from testpaths import PARROT

from areal_cli import supervisor

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]
MODEL = "tiny-parrot"
BOUND = 64
FLOOD_CLIENTS = 48
FLOOD_S = 20.0
BURST = 160


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory) -> Iterator[Stack]:
    with pytest.MonkeyPatch.context() as mp:
        # Through the environment, so that the same test runs against a proxy without the
        # setting (it then takes every request: no 429 at all).
        mp.setenv("AREAL_PROXY_MAX_INFLIGHT", str(BOUND))
        s = start_stack(tmp_path_factory.mktemp("overload"), sglang_engine.url, PARROT, n_proxies=1)
    yield s
    s.stop()


def _body(i: int) -> dict:
    # The parrot repeats the prompt's last token: 48 tokens of answer each.
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"flood {i}"}],
        "max_tokens": 48,
        "stream": i % 2 == 1,
    }


async def _chat(c: httpx.AsyncClient, i: int, out: list[tuple[int, str, str]]) -> None:
    body = _body(i)
    try:
        if body["stream"]:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                raw = await r.aread()
        else:
            r = await c.post("/v1/chat/completions", json=body)
            raw = r.content
    except httpx.HTTPError as e:
        out.append((-1, "", repr(e)))
        return
    out.append((r.status_code, r.headers.get("retry-after", ""), raw.decode(errors="replace")))


async def _sample(stack: Stack, stop: asyncio.Event, seen: list[tuple[str, float]]) -> None:
    proxy = stack.proxies[0]
    while not stop.is_set():
        health = await asyncio.to_thread(
            lambda: [w.get("health") for w in workers(stack) if w.get("model") == MODEL]
        )
        engine = await asyncio.to_thread(metric, proxy, "areal_proxy_engine_healthy")
        seen.append((str(health), engine))
        await asyncio.sleep(0.5)


async def _flood(stack: Stack) -> tuple[list, list, list]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    limits = httpx.Limits(max_connections=BURST + 16, max_keepalive_connections=BURST + 16)
    flood: list[tuple[int, str, str]] = []
    burst: list[tuple[int, str, str]] = []
    seen: list[tuple[str, float]] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(
        base_url=stack.gateway_url, headers=headers, timeout=240, limits=limits
    ) as c:
        sampler = asyncio.create_task(_sample(stack, stop, seen))
        end = time.monotonic() + FLOOD_S

        async def client(k: int) -> None:
            n = 0
            while time.monotonic() < end:
                await _chat(c, k * 1000 + n, flood)
                n += 1

        await asyncio.gather(*(client(k) for k in range(FLOOD_CLIENTS)))
        await asyncio.gather(*(_chat(c, 10**6 + i, burst) for i in range(BURST)))
        stop.set()
        await sampler
    return flood, burst, seen


def test_a_flood_is_queued_then_refused_with_429_never_a_5xx(stack, sglang_engine):
    engine = sglang_engine.component
    pid = engine.pid
    flood, burst, seen = asyncio.run(_flood(stack))
    statuses = Counter(s for s, _, _ in flood + burst)
    print(f"\nflood {len(flood)} requests, burst {len(burst)}: statuses {dict(statuses)}")
    bad = [(s, body[:300]) for s, _, body in flood + burst if s not in (200, 429)]
    assert not bad, f"answers other than 200/429: {Counter(s for s, _ in bad)}; first: {bad[:3]}"
    # Within the bound the engine queues: every chat of the flood answers.
    assert {s for s, _, _ in flood} == {200}, Counter(s for s, _, _ in flood)
    refused = [(ra, body) for s, ra, body in flood + burst if s == 429]
    assert any(s == 429 for s, _, _ in burst), f"a burst of {BURST} past a bound of {BOUND}"
    for retry_after, body in refused:
        assert retry_after and int(retry_after) >= 1, body
        assert '"code":"overloaded"' in body.replace(" ", ""), body
        assert '"type":"rate_limit_error"' in body.replace(" ", ""), body
    # The router never took the proxy out, the proxy never took its engine for lost.
    assert seen, "nothing sampled"
    assert all("UN" not in h.upper() and "HEALTHY" in h.upper() for h, _ in seen), seen
    assert all(e == 1.0 for _, e in seen), seen
    # Same engine process, and it answers.
    assert engine.pid == pid and supervisor.group_alive(engine)
    with stack.admin() as c:
        r = c.post("/v1/chat/completions", json={**_body(0), "stream": False})
        assert r.status_code == 200, r.text
