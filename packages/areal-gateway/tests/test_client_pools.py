"""A client with a big connection pool (one `AsyncOpenAI` or `ArealClient` driving hundreds of
rollouts) loses no request: the per-client connection limits must never close a connection
that carries a request, or one the client may be writing to. Real sockets: aiohttp and httpx
pools against the real gateway (uvicorn with the guarded protocol, its default limits)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import httpx
import pytest
from conftest import ADMIN_KEY, Stack

MODEL = "m-pool"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
POOL = 500
WAVES = 4


@pytest.fixture(scope="module")
def pool_gateway(stack: Stack):
    stack.register(MODEL)
    # The defaults an operator gets (the per-client limit is below the pool size).
    return stack.start_gateway()


def _failures(results: list[Any]) -> list[str]:
    return [repr(r) for r in results if r != 200]


async def _aiohttp_waves(url: str) -> list[Any]:
    results: list[Any] = []
    conn = aiohttp.TCPConnector(limit=POOL)
    async with aiohttp.ClientSession(url, connector=conn, headers=HEADERS) as http:

        async def one() -> Any:
            try:
                async with http.post("/v1/chat/completions", json=BODY) as r:
                    await r.read()
                    return r.status
            except (TimeoutError, aiohttp.ClientError) as e:
                return e

        for _ in range(WAVES):
            results += await asyncio.gather(*(one() for _ in range(POOL)))
    return results


async def _httpx_waves(url: str, waves: int) -> list[Any]:
    results: list[Any] = []
    limits = httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL)
    async with httpx.AsyncClient(base_url=url, limits=limits, headers=HEADERS, timeout=60) as http:

        async def one() -> Any:
            try:
                r = await http.post("/v1/chat/completions", json=BODY)
                return r.status_code
            except httpx.HTTPError as e:
                return e

        for _ in range(waves):
            results += await asyncio.gather(*(one() for _ in range(POOL)))
    return results


def test_an_aiohttp_pool_of_500_loses_nothing(pool_gateway) -> None:
    results = asyncio.run(_aiohttp_waves(pool_gateway.url))
    assert len(results) == POOL * WAVES
    bad = _failures(results)
    assert not bad, f"{len(bad)} of {len(results)} failed, e.g. {bad[:3]}"


def test_an_httpx_pool_of_500_loses_nothing(pool_gateway) -> None:
    # httpx's pool is slower per request than aiohttp's: two waves (1,000 requests) suffice.
    results = asyncio.run(_httpx_waves(pool_gateway.url, waves=2))
    bad = _failures(results)
    assert not bad, f"{len(bad)} of {len(results)} failed, e.g. {bad[:3]}"
