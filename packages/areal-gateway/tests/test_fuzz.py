"""Property-based fuzz of the gateway's endpoints with both key kinds.

Every body, well-formed or not, through the real gateway app (uvicorn on loopback) in front of
the FAKE router and proxies (conftest.py): no answer is a 500, every error is OpenAI-shaped,
and a malformed generation body gets the same 4xx (status and param) with the admin key as
with a session key. The fakes lack the RL and control RPCs, so a well-formed RL or control
body may end in the fakes' 502/503; generation, the model list and the admin model API never
answer >= 500 here. tests/e2e/test_fuzz_real_proxy.py sends the generation bodies on to the
real proxy.

Bounded for CI: derandomized (the same examples every run), a fixed count, no deadline.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest
from conftest import ADMIN_KEY, Stack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# ~0.1-0.3 s an example on the shared 2-core CI machine (two keys, loopback HTTP + gRPC).
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MODEL = "m-fuzz"

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-2, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
TEXT = st.text(max_size=10)


def obj(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """An object with any of `fields` (each its plausible value or any JSON), sometimes not an
    object at all, or not JSON."""
    return st.one_of(
        st.fixed_dictionaries({}, optional={k: v | JSON for k, v in fields.items()}),
        st.fixed_dictionaries({}, optional={k: v | JSON for k, v in fields.items()}),
        JSON,
        st.binary(max_size=12),
    )


MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | JSON},
    optional={"content": TEXT | JSON, "tool_calls": JSON, "name": JSON},
)
GENERATION = {
    "model": st.just(MODEL) | st.sampled_from(["", "no-such-model"]),
    "stream": st.booleans(),
    "max_tokens": st.integers(-1, 4),
    "stream_options": JSON,
}
CHAT = obj({**GENERATION, "messages": st.lists(MESSAGE, max_size=2)})
COMPLETION = obj({**GENERATION, "prompt": TEXT | st.lists(st.integers(0, 50), max_size=3)})
# Names under "fz-": the fuzz never deletes a model another test registered.
NAME = st.from_regex(r"fz-[a-z0-9.]{1,8}", fullmatch=True) | TEXT
ADDRESS = st.sampled_from(["127.0.0.1:1", "127.0.0.1", ":80", "127.0.0.1:99999"]) | TEXT
PROXY = obj({"proxy_id": TEXT, "address": ADDRESS})
REGISTER = obj(
    {
        "name": NAME,
        "kind": st.sampled_from(["internal", "external", "other"]),
        "proxies": st.lists(PROXY, max_size=2),
        "base_url": st.just("http://127.0.0.1:1/v1") | TEXT,
        "api_key": TEXT,
    }
)
SESSION_IDS = st.lists(TEXT, max_size=2)
BOUND = st.integers(-2, 100) | st.none() | JSON
ADMISSION = obj(
    {
        "max_staleness": BOUND,
        "batch_size": BOUND,
        "max_concurrent_rollouts": BOUND,
        "reset_consumed": st.booleans() | JSON,
    }
)
RL = {
    "/rl/start_session": obj(
        {
            "task_id": TEXT,
            "group_size": st.integers(-1, 3),
            "model": st.just(MODEL) | TEXT,
            "wait_s": st.floats(-1, 700) | JSON,
        }
    ),
    "/rl/set_reward": obj(
        {"reward": st.floats(allow_nan=False), "interaction_id": TEXT, "session_id": TEXT}
    ),
    "/rl/end_session": obj({"session_ids": SESSION_IDS}),
    "/rl/export_trajectories": obj(
        {
            "group_id": TEXT,
            "session_ids": SESSION_IDS,
            "style": st.sampled_from(["individual", "concat", "x"]),
            "discount": st.floats(allow_nan=False),
            "remove_session": st.booleans(),
        }
    ),
}
CONTROL = {
    f"/admin/{action}": obj(
        {"model": st.just(MODEL) | TEXT, "worker": TEXT, "version": st.integers(), "path": TEXT}
    )
    for action in ("pause", "continue", "set_version", "update_weights")
}
# (method, path or path strategy, body strategy or None, whether the fakes may 5xx it)
ENDPOINTS: list[tuple[str, Any, Any, bool]] = [
    ("POST", "/v1/chat/completions", CHAT, False),
    ("POST", "/v1/completions", COMPLETION, False),
    ("GET", "/v1/models", None, False),
    (
        "GET",
        st.builds(lambda n: f"/v1/models/{quote(n, safe='')}", NAME | st.just(MODEL)),
        None,
        False,
    ),
    ("GET", "/admin/models", None, False),
    ("POST", "/admin/models", REGISTER, False),
    ("DELETE", st.builds(lambda n: f"/admin/models/{quote(n, safe='')}", NAME), None, False),
    ("POST", st.builds(lambda n: f"/admin/models/{quote(n, safe='')}/proxies", NAME), PROXY, False),
    ("GET", "/admin/workers", None, False),
    ("GET", "/admin/admission", None, True),
    (
        "PUT",
        st.builds(lambda n: f"/admin/models/{quote(n, safe='')}/admission", NAME | st.just(MODEL)),
        ADMISSION,
        True,
    ),
    *(("POST", path, body, True) for path, body in RL.items()),
    *(("POST", path, body, True) for path, body in CONTROL.items()),
]
# What a FAKE neighbour without the RPC answers (its UNIMPLEMENTED, a missing session).
FAKE_5XX = {"upstream_error", "upstream_unavailable", "no_healthy_replica", None}


@pytest.fixture(scope="module")
def keys(stack: Stack) -> dict[str, str]:
    stack.register(MODEL)
    sid = "sess-" + "f" * 24
    return {"admin": ADMIN_KEY, "session": stack.gw.gateway.auth.mint_session_key(sid)}


def _encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


def _send(c: httpx.Client, method: str, path: str, key: str, body: Any) -> httpx.Response:
    content = None if body is None else _encode(body)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return c.request(method, path, headers=headers, content=content)


def _check_shape(r: httpx.Response, may_5xx: bool, what: Any) -> None:
    assert r.status_code != 500, (what, r.text)
    if r.status_code >= 400:
        doc = r.json()
        if may_5xx and isinstance(doc, dict) and "workers" in doc and "action" in doc:
            return  # generation control's per-worker report (docs/services.md), fakes' errors
        assert isinstance(doc, dict) and isinstance(doc.get("error"), dict), (what, r.text)
        err = doc["error"]
        assert isinstance(err["message"], str) and err["message"], (what, err)
        assert isinstance(err["type"], str) and err["type"], (what, err)
        if r.status_code >= 500:
            assert may_5xx and err["code"] in FAKE_5XX, (what, r.status_code, err)


@st.composite
def requests(draw: Any) -> tuple[str, str, Any, bool]:
    method, path, body, may_5xx = draw(st.sampled_from(ENDPOINTS))
    if not isinstance(path, str):
        path = draw(path)
    return method, path, (draw(body) if body is not None else None), may_5xx


@FUZZ
@given(req=requests())
def test_no_endpoint_answers_500_to_any_body_with_either_key(
    stack: Stack, keys: dict[str, str], req: tuple[str, str, Any, bool]
) -> None:
    method, path, body, may_5xx = req
    with httpx.Client(base_url=stack.url, timeout=20) as c:
        for kind, key in keys.items():
            r = _send(c, method, path, key, body)
            _check_shape(r, may_5xx, (kind, method, path, body))


@FUZZ
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), data=st.data())
def test_a_malformed_generation_body_gets_the_same_4xx_whatever_the_key(
    stack: Stack, keys: dict[str, str], path: str, data: Any
) -> None:
    body = data.draw(CHAT if "chat" in path else COMPLETION)
    with httpx.Client(base_url=stack.url, timeout=20) as c:
        got = {}
        for kind, key in keys.items():
            r = _send(c, "POST", path, key, body)
            assert r.status_code < 500, (kind, path, body, r.text)
            param = r.json()["error"]["param"] if r.status_code >= 400 else None
            got[kind] = (r.status_code, param)
        assert got["admin"] == got["session"], (path, body, got)
