"""A replica's back-pressure reaches the client as it was said: the proxy's 429 `overloaded`
(past its --max-inflight) carries when to come back, and the gateway answers it with a
`Retry-After` header, whole or streamed (it answered the 429 with no header: a client had
nothing to wait on). Real sockets: the gateway and fake proxies."""

from __future__ import annotations

import pytest
from conftest import ADMIN_KEY, Stack

HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
FAKE = {
    "error_status": 429,
    "error_code": "overloaded",
    "error_message": "this replica holds 512 requests, its bound",
    "retry_after_s": 3,
}


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    stack.register("m-busy")
    return "m-busy"


@pytest.mark.parametrize("stream", [False, True])
def test_an_overloaded_replica_is_a_429_with_retry_after(model, http, stream: bool) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "fake": FAKE,
    }
    r = http.post("/v1/chat/completions", json=body, headers=HEADERS)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3"
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "overloaded"), err
