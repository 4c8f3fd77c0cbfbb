"""Chat and completions through the real gateway (HTTP + gRPC over loopback)."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import orjson
import pytest
from conftest import ADMIN_KEY, Stack, wait_until

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    stack.register("m-chat")
    return "m-chat"


def sdk(stack: Stack, key: str = ADMIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def test_chat_non_stream_with_sdk(stack: Stack, model: str) -> None:
    resp = sdk(stack).chat.completions.create(model=model, messages=MESSAGES)  # type: ignore[arg-type]
    assert resp.choices[0].message.content.startswith("hello from p")
    assert resp.object == "chat.completion"
    assert resp.model == model


def test_chat_stream_with_sdk(stack: Stack, model: str) -> None:
    stream = sdk(stack).chat.completions.create(model=model, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == "t0 t1 t2 "


def test_completions_non_stream_and_stream_with_sdk(stack: Stack, model: str) -> None:
    client = sdk(stack)
    resp = client.completions.create(model=model, prompt="hello")
    assert resp.choices[0].text.startswith("hello from p")
    chunks = list(client.completions.create(model=model, prompt=[1, 2, 3], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "t0 t1 t2 "


async def test_async_sdk_chat_and_completions(stack: Stack, model: str) -> None:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    resp = await client.chat.completions.create(model=model, messages=MESSAGES)  # type: ignore[arg-type]
    assert resp.choices[0].message.content
    stream = await client.chat.completions.create(model=model, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    parts = [c.choices[0].delta.content async for c in stream]
    assert parts == ["t0 ", "t1 ", "t2 "]
    cstream = await client.completions.create(model=model, prompt="x", stream=True)
    assert [c.choices[0].text async for c in cstream] == ["t0 ", "t1 ", "t2 "]
    await client.close()


def test_aliases_without_v1(stack: Stack, model: str, http: httpx.Client, admin_headers) -> None:
    r = http.post(
        "/chat/completions", headers=admin_headers, json={"model": model, "messages": MESSAGES}
    )
    assert r.status_code == 200, r.text
    r = http.post("/completions", headers=admin_headers, json={"model": model, "prompt": "x"})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


def test_body_bytes_and_envelope_reach_the_proxy_untouched(
    stack: Stack, model: str, http: httpx.Client, admin_headers
) -> None:
    rid = "req-" + uuid.uuid4().hex
    body = (
        b'{ "model" : "m-chat",\n "messages": [{"role":"user","content":"hi \\u00e9"}],'
        b' "x_unknown": {"nested": [1, 2.50, null]}, "temperature": 0.7, "logit_bias": {"1": -100} }'
    )
    before = time.time()
    r = http.post(
        "/v1/chat/completions",
        content=body,
        headers={**admin_headers, "content-type": "application/json", "x-request-id": rid},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    got = stack.find(rid)
    assert got.method == "ChatCompletion"
    assert got.body == body  # byte for byte: nothing re-serialized, nothing dropped
    env = got.envelope
    assert env.model == model and env.api_key == ADMIN_KEY and env.is_admin
    assert env.stream is False and env.session_id == ""
    assert before * 1000 + 29_000 < env.deadline_unix_ms < time.time() * 1000 + 31_000
    # the gRPC deadline travels too, and so does the internal token
    # (grpc-timeout travels in whole units and is rounded up on the wire: a little over 30)
    assert got.time_remaining is not None and 25 < got.time_remaining <= 30.5
    assert got.metadata["x-areal-internal-token"]


def test_stream_flag_and_completion_method(stack: Stack, model: str, http, admin_headers) -> None:
    rid = "req-" + uuid.uuid4().hex
    with http.stream(
        "POST",
        "/v1/completions",
        headers={**admin_headers, "x-request-id": rid},
        json={"model": model, "prompt": "x", "stream": True},
    ) as r:
        assert r.status_code == 200
        r.read()
    got = stack.find(rid)
    assert got.method == "CompletionStream" and got.envelope.stream is True


def test_sse_framing_is_exactly_openai(stack: Stack, model: str, http, admin_headers) -> None:
    with http.stream(
        "POST",
        "/v1/chat/completions",
        headers=admin_headers,
        json={"model": model, "messages": MESSAGES, "stream": True},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith(b"data: ")
        assert orjson.loads(ev[6:])["object"] == "chat.completion.chunk"
    assert len(events) == 5


def test_first_chunk_arrives_before_the_last_is_produced(
    stack: Stack, model: str, http, admin_headers
) -> None:
    rid = "req-" + uuid.uuid4().hex
    for p in stack.proxies.values():
        p.gate.clear()
    try:
        with http.stream(
            "POST",
            "/v1/chat/completions",
            headers={**admin_headers, "x-request-id": rid},
            json={
                "model": model,
                "messages": MESSAGES,
                "stream": True,
                "fake": {"chunks": 4, "gate": True},
            },
        ) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            received_first = time.monotonic()
            # The fake proxy holds back its last chunk until we have seen the first.
            produced = [t for (req, i, t) in stack.all_produced() if req == rid]
            assert len(produced) < 4
            for p in stack.proxies.values():
                p.gate.set()
            rest = [line for line in lines if line]
        assert first.startswith("data: {")
        assert rest[-1] == "data: [DONE]" and len(rest) == 4
        last_produced = max(t for (req, i, t) in stack.all_produced() if req == rid)
        assert received_first < last_produced
        assert not any(rid in p.gate_timed_out for p in stack.proxies.values())
    finally:
        for p in stack.proxies.values():
            p.gate.clear()


def test_client_disconnect_mid_stream_cancels_the_proxy_call(
    stack: Stack, model: str, admin_headers
) -> None:
    rid = "req-" + uuid.uuid4().hex
    with httpx.Client(base_url=stack.url, timeout=10) as client:
        with client.stream(
            "POST",
            "/v1/chat/completions",
            headers={**admin_headers, "x-request-id": rid},
            json={
                "model": model,
                "messages": MESSAGES,
                "stream": True,
                "fake": {"chunks": 1, "hang": True},
            },
        ) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line)
            assert first.startswith("data: ")
        # leaving the block closes the connection mid-stream
    assert wait_until(lambda: any(rid in p.cancelled for p in stack.proxies.values()), 5)


def test_client_disconnect_during_unary_call_cancels_it(
    stack: Stack, model: str, admin_headers
) -> None:
    rid = "req-" + uuid.uuid4().hex
    with httpx.Client(base_url=stack.url, timeout=0.5) as client, pytest.raises(httpx.ReadTimeout):
        client.post(
            "/v1/chat/completions",
            headers={**admin_headers, "x-request-id": rid},
            json={"model": model, "messages": MESSAGES, "fake": {"sleep": 30}},
        )
    assert wait_until(lambda: any(rid in p.cancelled for p in stack.proxies.values()), 5)


def test_requests_spread_over_replicas(stack: Stack, model: str, http, admin_headers) -> None:
    seen = set()
    for _ in range(4):
        r = http.post(
            "/v1/chat/completions",
            headers=admin_headers,
            json={"model": model, "messages": MESSAGES},
        )
        seen.add(r.json()["choices"][0]["message"]["content"])
    assert seen == {"hello from p0", "hello from p1"}


def test_refused_connection_goes_to_another_replica(stack: Stack, http, admin_headers) -> None:
    from conftest import free_port

    from areal_proto.router.v1 import router_pb2

    stack.register("m-dead", ["p0"])
    stack.router.proxies["m-dead-gone"] = router_pb2.ProxyInfo(
        proxy_id="m-dead-gone",
        address=f"127.0.0.1:{free_port()}",
        model="m-dead",
        kind=router_pb2.PROXY_KIND_INFERENCE,
        health=router_pb2.PROXY_HEALTH_HEALTHY,
    )
    for stream in (False, True, False, True):
        body = {"model": "m-dead", "messages": MESSAGES, "stream": stream}
        r = http.post("/v1/chat/completions", headers=admin_headers, json=body)
        assert r.status_code == 200, r.text
    metrics = http.get("/metrics").text
    assert "areal_gateway_route_retries_total" in metrics
    retries = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("areal_gateway_route_retries_total ")
    ]
    assert retries and retries[0] >= 1


def test_draining_replica_sends_requests_elsewhere_but_not_sessions(
    stack: Stack, model: str, http, admin_headers
) -> None:
    # p0 refuses as a draining proxy does (before doing any work); p1 serves.
    fake = {"draining_on": ["p0"]}
    for stream in (False, True, False, True):
        body = {"model": model, "messages": MESSAGES, "stream": stream, "fake": fake}
        r = http.post("/v1/chat/completions", headers=admin_headers, json=body)
        assert r.status_code == 200, r.text
        assert stream or r.json()["choices"][0]["message"]["content"] == "hello from p1"
    # A session's requests stay with its replica (its records live there): the 503 is passed on.
    stack.gw.gateway.auth.add_session_key("sess-key-drain-abcdefghijk", "session-drain")
    statuses = set()
    for _ in range(4):
        r = http.post(
            "/v1/chat/completions",
            headers={"Authorization": "Bearer sess-key-drain-abcdefghijk"},
            json={"model": model, "messages": MESSAGES, "fake": fake},
        )
        statuses.add(r.status_code)
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "draining"
    assert 503 in statuses


def test_session_key_principal_reaches_proxy(stack: Stack, model: str, http) -> None:
    stack.gw.gateway.auth.add_session_key("sess-key-abcdefghijklmnop", "session-7")
    rid = "req-" + uuid.uuid4().hex
    r = http.post(
        "/v1/chat/completions",
        headers={"Authorization": "Bearer sess-key-abcdefghijklmnop", "x-request-id": rid},
        json={"model": model, "messages": MESSAGES},
    )
    assert r.status_code == 200, r.text
    env = stack.find(rid).envelope
    assert env.session_id == "session-7" and not env.is_admin
    assert stack.router.routes[-1].session_id == "session-7"
    # The admin key is never a routing identity.
    http.post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        json={"model": model, "messages": MESSAGES},
    )
    assert stack.router.routes[-1].session_id == ""


def test_models_list_with_sdk_and_cache(stack: Stack, model: str) -> None:
    client = sdk(stack)
    ids = [m.id for m in client.models.list()]
    assert model in ids
    calls = stack.router.list_models_calls
    client.models.list()
    client.models.list()
    assert stack.router.list_models_calls - calls <= 1
    stack.register("m-late")
    time.sleep(1.1)
    assert "m-late" in [m.id for m in client.models.list()]


def test_models_retrieve_with_sdk(stack: Stack, model: str) -> None:
    client = sdk(stack)
    m = client.models.retrieve(model)
    assert m.id == model and m.object == "model" and m.created == 1700000000
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_health_and_metrics_need_no_key(stack: Stack, http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200
    body = r.json()
    # "degraded": other tests' broken models on the shared fake router (test_health.py).
    assert body["status"] in ("ok", "degraded")
    assert isinstance(body["pid"], int) and len(body["instance"]) >= 8
    m = http.get("/metrics")
    assert m.status_code == 200
    assert "areal_gateway_requests_total" in m.text
    assert 'endpoint="chat"' in m.text
