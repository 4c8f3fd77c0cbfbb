"""The gateway's request counter: a client that goes away before any response is its own
outcome (status 499), never a 500; each request is labelled with its model, only models the
catalog knows (else "unknown"; "none" where no model is named)."""

from __future__ import annotations

import re
import time
import uuid

import httpx
import pytest
from conftest import ADMIN_KEY, Stack, wait_until

HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "m-metrics"


@pytest.fixture(scope="module")
def gw(stack: Stack):
    stack.register(MODEL)
    return stack.start_gateway()


def _count(url: str, endpoint: str, status: str, model: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = {"endpoint": endpoint, "status": status, "model": model}
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("areal_gateway_requests_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if labels == want:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_requests_are_counted_by_model(gw) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=gw.url, headers=HEADERS, timeout=10) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        time.sleep(1.1)  # the catalog's snapshot holds the model by now
        before = _count(gw.url, "chat", "200", MODEL)
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert _count(gw.url, "chat", "200", MODEL) == before + 1
        # A made-up model name is no series of its own.
        name = "no-such-model-" + uuid.uuid4().hex[:8]
        r = c.post("/v1/chat/completions", json={**body, "model": name})
        assert r.status_code == 404
        assert _count(gw.url, "chat", "404", "unknown") >= 1
        assert name not in httpx.get(f"{gw.url}/metrics").text
        assert c.get("/health").status_code == 200
        assert _count(gw.url, "health", "200", "none") >= 1


def test_a_client_that_goes_away_is_a_499_not_a_500(gw) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "fake": {"sleep": 30},
    }
    before_500 = _count(gw.url, "chat", "500", MODEL)
    with httpx.Client(base_url=gw.url, headers=HEADERS, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=body)
    assert wait_until(lambda: _count(gw.url, "chat", "499", MODEL) >= 1, 5)
    assert _count(gw.url, "chat", "500", MODEL) == before_500
