"""Every bad input gets the right status and an OpenAI-shaped error; the gateway keeps serving."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from conftest import ADMIN_KEY, MAX_BODY, Stack

from areal_proto.router.v1 import router_pb2

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    stack.register("m-err")
    return "m-err"


def assert_error(
    r: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "Traceback" not in r.text
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json_and_non_objects(http: httpx.Client, admin_headers, path: str) -> None:
    h = {**admin_headers, "content-type": "application/json"}
    assert_error(http.post(path, headers=h, content=b'{"model": "m", '), 400, "invalid_json")
    assert_error(http.post(path, headers=h, content=b""), 400, "invalid_json")
    assert_error(http.post(path, headers=h, content=b"\xff\xfe"), 400, "invalid_json")
    for body in (b"[]", b'"x"', b"42", b"null"):
        assert_error(http.post(path, headers=h, content=body), 400, "invalid_body")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_model_and_stream_checks(http: httpx.Client, admin_headers, path: str) -> None:
    extra = {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
    assert_error(http.post(path, headers=admin_headers, json=extra), 400, param="model")
    assert_error(
        http.post(path, headers=admin_headers, json={**extra, "model": 3}), 400, param="model"
    )
    assert_error(
        http.post(path, headers=admin_headers, json={**extra, "model": ""}), 400, param="model"
    )
    assert_error(
        http.post(path, headers=admin_headers, json={**extra, "model": "m-err", "stream": "yes"}),
        400,
        param="stream",
    )


def test_chat_messages_checks(http: httpx.Client, admin_headers) -> None:
    p = "/v1/chat/completions"
    assert_error(
        http.post(p, headers=admin_headers, json={"model": "m-err"}),
        400,
        "missing_required_parameter",
        "messages",
    )
    assert_error(
        http.post(p, headers=admin_headers, json={"model": "m-err", "messages": []}),
        400,
        param="messages",
    )
    assert_error(
        http.post(p, headers=admin_headers, json={"model": "m-err", "messages": "hi"}),
        400,
        param="messages",
    )


def test_completions_prompt_required(http: httpx.Client, admin_headers) -> None:
    p = "/v1/completions"
    assert_error(
        http.post(p, headers=admin_headers, json={"model": "m-err"}),
        400,
        "missing_required_parameter",
        "prompt",
    )
    assert_error(
        http.post(p, headers=admin_headers, json={"model": "m-err", "prompt": None}),
        400,
        param="prompt",
    )


def test_auth_errors(http: httpx.Client, model: str) -> None:
    body = {"model": model, "messages": MESSAGES}
    assert_error(http.post("/v1/chat/completions", json=body), 401, "missing_api_key")
    assert_error(
        http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}),
        401,
        "invalid_api_key",
    )
    assert_error(
        http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Basic {ADMIN_KEY}"}
        ),
        401,
    )
    assert_error(http.get("/v1/models"), 401)
    assert_error(http.get("/admin/models"), 401)
    assert_error(http.get("/admin/workers", headers={"Authorization": "Bearer wrong"}), 401)


def test_session_key_cannot_use_admin_api(stack: Stack, http: httpx.Client) -> None:
    stack.gw.gateway.auth.add_session_key("sess-key-admin-test-xyz", "s-1")
    assert_error(
        http.get("/admin/workers", headers={"Authorization": "Bearer sess-key-admin-test-xyz"}), 403
    )


def test_unknown_model_404(http: httpx.Client, admin_headers) -> None:
    r = http.post(
        "/v1/chat/completions", headers=admin_headers, json={"model": "nope", "messages": MESSAGES}
    )
    assert_error(r, 404, "model_not_found")
    r = http.post(
        "/v1/completions",
        headers=admin_headers,
        json={"model": "nope", "prompt": "x", "stream": True},
    )
    assert_error(r, 404)


def test_no_healthy_replica_503(stack: Stack, http: httpx.Client, admin_headers) -> None:
    stack.register("m-sick")
    for pid in ("m-sick-p0", "m-sick-p1"):
        stack.router.set_health(pid, router_pb2.PROXY_HEALTH_UNHEALTHY)
    for stream in (False, True):
        r = http.post(
            "/v1/chat/completions",
            headers=admin_headers,
            json={"model": "m-sick", "messages": MESSAGES, "stream": stream},
        )
        assert_error(r, 503)
    stack.router.set_health("m-sick-p1", router_pb2.PROXY_HEALTH_HEALTHY)
    r = http.post(
        "/v1/chat/completions",
        headers=admin_headers,
        json={"model": "m-sick", "messages": MESSAGES},
    )
    assert r.status_code == 200


def test_proxy_validation_error_passes_through(
    http: httpx.Client, admin_headers, model: str
) -> None:
    for stream in (False, True):
        r = http.post(
            "/v1/chat/completions",
            headers=admin_headers,
            json={"model": model, "messages": MESSAGES, "max_tokens": 0, "stream": stream},
        )
        err = assert_error(r, 400, "invalid_value", "max_tokens")
        assert err["message"] == "max_tokens must be at least 1"
        assert err["type"] == "invalid_request_error"


def test_proxy_failure_502(http: httpx.Client, admin_headers, model: str) -> None:
    for stream in (False, True):
        r = http.post(
            "/v1/chat/completions",
            headers=admin_headers,
            json={"model": model, "messages": MESSAGES, "stream": stream, "fake": {"crash": True}},
        )
        assert_error(r, 502)


def test_error_after_first_chunk_is_a_final_event(
    http: httpx.Client, admin_headers, model: str
) -> None:
    with http.stream(
        "POST",
        "/v1/chat/completions",
        headers=admin_headers,
        json={
            "model": model,
            "messages": MESSAGES,
            "stream": True,
            "fake": {"chunks": 5, "error_after": 2},
        },
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert len(events) == 4
    assert events[-1] == "data: [DONE]"
    import json

    err = json.loads(events[-2][6:])["error"]
    assert err["message"] == "engine died mid-stream" and err["code"] == "engine_error"
    assert set(err) == {"message", "type", "code", "param"}


def test_deadline_504(stack: Stack, model: str) -> None:
    gw = stack.start_gateway(request_timeout=0.5)
    with httpx.Client(
        base_url=gw.url, timeout=10, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ) as c:
        t0 = time.monotonic()
        r = c.post(
            "/v1/chat/completions",
            json={"model": model, "messages": MESSAGES, "fake": {"sleep": 5}},
        )
        assert_error(r, 504)
        assert time.monotonic() - t0 < 3
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": MESSAGES,
                "stream": True,
                "fake": {"chunks": 1, "hang": True},
            },
        )
        # deadline after the first chunk: the stream ends with an error event
        assert r.status_code == 200
        assert '"timeout_error"' in r.text or "upstream_timeout" in r.text
        assert r.text.endswith("data: [DONE]\n\n")


def test_body_too_large_by_content_length(http: httpx.Client, admin_headers) -> None:
    big = b'{"model": "m-err", "messages": [], "pad": "' + b"x" * MAX_BODY + b'"}'
    r = http.post(
        "/v1/chat/completions",
        headers={**admin_headers, "content-type": "application/json"},
        content=big,
    )
    assert_error(r, 413, "body_too_large")


def test_body_too_large_chunked(http: httpx.Client, admin_headers) -> None:
    def chunks():
        yield b'{"model": "m-err", "pad": "'
        for _ in range(MAX_BODY // 8192 + 2):
            yield b"x" * 8192
        yield b'"}'

    r = http.post(
        "/v1/chat/completions",
        headers={**admin_headers, "content-type": "application/json"},
        content=chunks(),
    )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert_error(r, 413, "body_too_large")


def test_lying_content_length_header_is_400(stack: Stack) -> None:
    port = int(stack.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n"
            b"Authorization: Bearer " + ADMIN_KEY.encode() + b"\r\n\r\n{}"
        )
        data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 4")


def test_framework_404_405_are_openai_shaped(http: httpx.Client, admin_headers) -> None:
    assert_error(http.get("/nope"), 404)
    assert_error(http.get("/v1/chat/completions", headers=admin_headers), 405)
    assert_error(http.put("/v1/completions", headers=admin_headers), 405)
    assert_error(http.delete("/admin/models", headers=admin_headers), 405)


def test_still_serving_after_all_that(http: httpx.Client, admin_headers, model: str) -> None:
    r = http.post(
        "/v1/chat/completions", headers=admin_headers, json={"model": model, "messages": MESSAGES}
    )
    assert r.status_code == 200
    # The gateway is up ("degraded" is the service behind it: the shared fake router holds
    # other tests' deliberately broken models; test_health.py checks that part).
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] in ("ok", "degraded")
