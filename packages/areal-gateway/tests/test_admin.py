"""The admin API round trip against the FAKE router, and external models."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest
from conftest import ADMIN_KEY, Stack, free_port
from fakes import UPSTREAM_KEY

MESSAGES = [{"role": "user", "content": "hi"}]


def test_internal_model_round_trip(stack: Stack, http: httpx.Client, admin_headers) -> None:
    body = {
        "name": "m-admin",
        "kind": "internal",
        "proxies": [
            {"proxy_id": "m-admin-data-proxy-0", "address": stack.proxy_addrs["p0"]},
            {"proxy_id": "m-admin-data-proxy-1", "address": stack.proxy_addrs["p1"]},
        ],
    }
    r = http.post("/admin/models", headers=admin_headers, json=body)
    assert r.status_code == 201, r.text
    assert r.json() == {"name": "m-admin", "kind": "internal", "proxies": body["proxies"]}
    stored = {p.proxy_id: p for p in stack.router.proxies.values() if p.model == "m-admin"}
    assert set(stored) == {"m-admin-data-proxy-0", "m-admin-data-proxy-1"}
    assert all(p.kind == 1 for p in stored.values())  # PROXY_KIND_INFERENCE

    # duplicate -> 409
    r = http.post("/admin/models", headers=admin_headers, json=body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_exists"

    # listed, with workers and their health and load
    models = http.get("/admin/models", headers=admin_headers).json()["models"]
    (m,) = [m for m in models if m["name"] == "m-admin"]
    assert m["kind"] == "internal"
    assert [w["proxy_id"] for w in m["workers"]] == ["m-admin-data-proxy-0", "m-admin-data-proxy-1"]
    w = m["workers"][0]
    assert w["health"] == "healthy" and w["inflight_requests"] == 3 and w["inflight_tokens"] == 42
    assert set(w) == {
        "proxy_id",
        "address",
        "health",
        "inflight_requests",
        "inflight_tokens",
        "sessions",
    }

    workers = http.get("/admin/workers", headers=admin_headers).json()["workers"]
    mine = [w for w in workers if w["model"] == "m-admin"]
    assert len(mine) == 2 and mine[0]["kind"] == "inference" and mine[0]["health"] == "healthy"
    # How each replica reads tools, as the router has it from the proxy's GetStats.
    stored["m-admin-data-proxy-0"].tool_call_parser = "hermes"
    stored["m-admin-data-proxy-0"].default_tool_prompt = True
    workers = http.get("/admin/workers", headers=admin_headers).json()["workers"]
    parsing = {
        w["proxy_id"]: (w["tool_call_parser"], w["reasoning_parser"], w["default_tool_prompt"])
        for w in workers
        if w["model"] == "m-admin"
    }
    assert parsing == {
        "m-admin-data-proxy-0": ("hermes", "", True),
        "m-admin-data-proxy-1": ("", "", False),
    }

    # usable right away
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    assert (
        client.chat.completions.create(model="m-admin", messages=MESSAGES)
        .choices[0]
        .message.content
    )  # type: ignore[arg-type]

    # one more replica
    r = http.post(
        "/admin/models/m-admin/proxies",
        headers=admin_headers,
        json={"proxy_id": "m-admin-data-proxy-2", "address": stack.proxy_addrs["p1"]},
    )
    assert r.status_code == 201, r.text
    assert "m-admin-data-proxy-2" in stack.router.proxies

    # deregister
    r = http.delete("/admin/models/m-admin", headers=admin_headers)
    assert r.status_code == 200
    assert r.json() == {
        "name": "m-admin",
        "proxy_ids": ["m-admin-data-proxy-0", "m-admin-data-proxy-1", "m-admin-data-proxy-2"],
    }
    r = http.delete("/admin/models/m-admin", headers=admin_headers)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "code", "param"}
    r = http.post(
        "/v1/chat/completions",
        headers=admin_headers,
        json={"model": "m-admin", "messages": MESSAGES},
    )
    assert r.status_code == 404


@pytest.mark.parametrize(
    "body, param",
    [
        ({"kind": "internal", "proxies": []}, "name"),
        ({"name": "x", "kind": "weird"}, "kind"),
        ({"name": "x", "proxies": "p"}, "proxies"),
        ({"name": "x", "proxies": [{"address": "127.0.0.1:1"}]}, "proxies.0.proxy_id"),
        ({"name": "x", "proxies": [{"proxy_id": "a", "address": "nohost"}]}, "proxies.0.address"),
        ({"name": "x", "proxies": [{"proxy_id": "a", "address": "h:99999"}]}, "proxies.0.address"),
        ({"name": "x", "kind": "external", "api_key": "k"}, "base_url"),
    ],
)
def test_register_rejects_bad_bodies(http: httpx.Client, admin_headers, body, param) -> None:
    r = http.post("/admin/models", headers=admin_headers, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_add_proxy_to_unknown_model_404(http: httpx.Client, admin_headers) -> None:
    r = http.post(
        "/admin/models/none/proxies",
        headers=admin_headers,
        json={"proxy_id": "a", "address": "127.0.0.1:5"},
    )
    assert r.status_code == 404


def test_admin_needs_admin_key(stack: Stack, http: httpx.Client) -> None:
    stack.gw.gateway.auth.add_session_key("sess-key-for-admin-check", "s-9")
    h = {"Authorization": "Bearer sess-key-for-admin-check"}
    assert http.get("/admin/models", headers=h).status_code == 403
    assert http.post("/admin/models", headers=h, json={"name": "z"}).status_code == 403
    assert http.delete("/admin/models/z", headers=h).status_code == 403


# --- external models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def external(stack: Stack) -> str:
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        r = c.post(
            "/admin/models",
            json={
                "name": "ext-gpt",
                "kind": "external",
                "base_url": stack.upstream_url + "/",
                "api_key": UPSTREAM_KEY,
                "upstream_model": "up-model",
            },
        )
    assert r.status_code == 201, r.text
    assert r.json() == {
        "name": "ext-gpt",
        "kind": "external",
        "base_url": stack.upstream_url,
        "upstream_model": "up-model",
    }
    return "ext-gpt"


def test_external_registration_is_validated(
    stack: Stack, http: httpx.Client, admin_headers
) -> None:
    def reg(**kw) -> httpx.Response:
        return http.post(
            "/admin/models",
            headers=admin_headers,
            json={"name": "ext-bad", "kind": "external", **kw},
        )

    for url in (
        "ftp://127.0.0.1/v1",
        "file:///etc/passwd",
        "not a url",
        "http://user:pw@127.0.0.1/v1",
    ):
        r = reg(base_url=url, api_key=UPSTREAM_KEY)
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["param"] == "base_url"
    r = reg(base_url=stack.upstream_url, api_key="wrong-key")
    assert r.status_code == 400 and "401" in r.json()["error"]["message"]
    r = reg(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key=UPSTREAM_KEY)
    assert r.status_code == 400 and "ConnectError" in r.json()["error"]["message"]
    r = reg(base_url=stack.upstream_url + "/nothing-here", api_key=UPSTREAM_KEY)
    assert r.status_code == 400 and "404" in r.json()["error"]["message"]
    assert "ext-bad" not in stack.router.models


def test_external_key_is_never_shown(
    stack: Stack, http: httpx.Client, admin_headers, external: str
) -> None:
    text = http.get("/admin/models", headers=admin_headers).text
    assert UPSTREAM_KEY not in text
    models = {
        m["name"]: m for m in http.get("/admin/models", headers=admin_headers).json()["models"]
    }
    assert (
        models[external]["kind"] == "external"
        and models[external]["base_url"] == stack.upstream_url
    )


def test_external_forwarding_non_stream_and_stream(stack: Stack, external: str) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    n = len(stack.upstream.received)
    resp = client.chat.completions.create(
        model=external, messages=MESSAGES, extra_body={"x_custom": 1}
    )  # type: ignore[arg-type]
    assert resp.choices[0].message.content == "from upstream"
    path, body, auth = stack.upstream.received[n]
    assert path == "/v1/chat/completions" and auth == f"Bearer {UPSTREAM_KEY}"
    doc = orjson.loads(body)
    assert doc["model"] == "up-model" and doc["x_custom"] == 1 and doc["messages"] == MESSAGES

    stream = client.chat.completions.create(model=external, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "u0 u1 u2 "

    resp2 = client.completions.create(model=external, prompt="p")
    assert resp2.choices[0].text == "from upstream"
    assert stack.upstream.received[-1][0] == "/v1/completions"
    chunks = list(client.completions.create(model=external, prompt="p", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "u0 u1 u2 "
    assert not any(r.envelope.model == external for r in stack.all_received())


def test_external_upstream_error_passes_through(
    http: httpx.Client, admin_headers, external: str
) -> None:
    r = http.post(
        "/v1/chat/completions",
        headers=admin_headers,
        json={"model": external, "messages": MESSAGES, "max_tokens": 0},
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens too small"


def test_external_model_forbidden_for_session_keys(
    stack: Stack, http: httpx.Client, external: str
) -> None:
    stack.gw.gateway.auth.add_session_key("sess-key-external-check", "s-ext")
    h = {"Authorization": "Bearer sess-key-external-check"}
    for stream in (False, True):
        r = http.post(
            "/v1/chat/completions",
            headers=h,
            json={"model": external, "messages": MESSAGES, "stream": stream},
        )
        assert r.status_code == 403, r.text
        assert set(r.json()["error"]) == {"message", "type", "code", "param"}
    # and not listed to them
    ids = [m["id"] for m in http.get("/v1/models", headers=h).json()["data"]]
    assert external not in ids
    ids = [
        m["id"]
        for m in http.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()[
            "data"
        ]
    ]
    assert external in ids


def test_external_model_known_only_to_the_router(
    stack: Stack, http: httpx.Client, admin_headers
) -> None:
    """Registered elsewhere (not through this gateway): Route says EXTERNAL, the gateway forwards."""
    from areal_proto.router.v1 import router_pb2

    stack.router.models["ext-elsewhere"] = router_pb2.ModelInfo(
        name="ext-elsewhere",
        kind=router_pb2.MODEL_KIND_EXTERNAL,
        base_url=stack.upstream_url,
        api_key=UPSTREAM_KEY,
        upstream_model="up-model",
    )
    r = http.post(
        "/v1/chat/completions",
        headers=admin_headers,
        json={"model": "ext-elsewhere", "messages": MESSAGES},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "from upstream"


def test_deregister_external(http: httpx.Client, admin_headers, external: str) -> None:
    r = http.delete(f"/admin/models/{external}", headers=admin_headers)
    assert r.status_code == 200 and r.json() == {"name": external, "proxy_ids": []}
    r = http.post(
        "/v1/chat/completions",
        headers=admin_headers,
        json={"model": external, "messages": MESSAGES},
    )
    assert r.status_code == 404


def test_retire_checks_its_worker_and_timeout_before_anything(
    stack: Stack, http: httpx.Client, admin_headers
) -> None:
    """The graceful drain of one worker (real proxies answer it: tests/e2e/test_drain.py)."""
    r = http.post("/admin/workers/nobody/retire", headers=admin_headers, json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
    r = http.post("/admin/workers/nobody/retire", headers=admin_headers, json={"drain_timeout": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "drain_timeout"
    r = http.post("/admin/workers/nobody/retire", json={})
    assert r.status_code == 401


def test_retire_refuses_the_last_serving_replica(
    stack: Stack, http: httpx.Client, admin_headers
) -> None:
    """Retiring a model's only replica would leave nothing to generate for it until a restart:
    refused as `areal inf deregister --replica` refuses it, and nothing is asked of the proxy."""
    body = {
        "name": "m-retire",
        "kind": "internal",
        "proxies": [{"proxy_id": "m-retire-data-proxy-0", "address": stack.proxy_addrs["p0"]}],
    }
    r = http.post("/admin/models", headers=admin_headers, json=body)
    assert r.status_code == 201, r.text
    try:
        r = http.post("/admin/workers/m-retire-data-proxy-0/retire", headers=admin_headers, json={})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "last_serving_replica" and err["param"] == "proxy_id"
        assert "last serving replica of model 'm-retire'" in err["message"]
        assert "deregister the model instead" in err["message"]
        assert stack.router.proxies["m-retire-data-proxy-0"].health == 1  # still healthy

        # A second replica that is itself retired (draining) takes no work: still refused.
        r = http.post(
            "/admin/models/m-retire/proxies",
            headers=admin_headers,
            json={"proxy_id": "m-retire-data-proxy-1", "address": stack.proxy_addrs["p1"]},
        )
        assert r.status_code in (200, 201), r.text
        stack.router.set_health("m-retire-data-proxy-1", 3)  # PROXY_HEALTH_DRAINING
        r = http.post("/admin/workers/m-retire-data-proxy-0/retire", headers=admin_headers, json={})
        assert r.status_code == 409 and r.json()["error"]["code"] == "last_serving_replica"

        # Once another replica serves, the check lets the retire through to the proxy (the
        # fake proxy has no Retire; real ones answer it in tests/e2e/test_drain.py); and a
        # retired worker may be retired again (idempotent) whatever its peers are.
        stack.router.set_health("m-retire-data-proxy-1", 2)  # unhealthy for now: counts
        r = http.post("/admin/workers/m-retire-data-proxy-0/retire", headers=admin_headers, json={})
        assert r.status_code != 409, r.text
        stack.router.set_health("m-retire-data-proxy-1", 3)
        r = http.post("/admin/workers/m-retire-data-proxy-1/retire", headers=admin_headers, json={})
        assert r.status_code != 409, r.text
    finally:
        http.delete("/admin/models/m-retire", headers=admin_headers)
