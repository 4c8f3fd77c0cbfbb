"""The OpenAPI document of a running gateway, and the typed JSON APIs behind it.

The document is compared with the routes the app really serves (so neither can drift from
the other), real answers are checked against the declared response models, and bad bodies
must keep the OpenAI error shape, after the key check.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import orjson
import pytest
from conftest import ADMIN_KEY, MAX_BODY, RunningGateway, Stack
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.routing import Route
from test_errors import assert_error

from areal_gateway.apidoc import described_routes
from areal_gateway.app import api_routers
from areal_runtime.session_keys import mint_key

# What each mode's document must list: the admin, RL and control APIs and the OpenAI and
# Anthropic API (inference), the session and pair APIs and the turns (agent). Not health or
# metrics.
OPENAI_OPERATIONS = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{name}"),
}
AGENT_TURNS = {
    ("POST", "/v1/responses"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{name}"),
}
INFERENCE_OPERATIONS = OPENAI_OPERATIONS | {
    ("GET", "/admin/models"),
    ("POST", "/admin/models"),
    ("DELETE", "/admin/models/{name}"),
    ("POST", "/admin/models/{name}/proxies"),
    ("GET", "/admin/workers"),
    ("GET", "/admin/admission"),
    ("GET", "/admin/models/{name}/admission"),
    ("PUT", "/admin/models/{name}/admission"),
    ("POST", "/admin/pause"),
    ("POST", "/admin/continue"),
    ("POST", "/admin/set_version"),
    ("POST", "/admin/update_weights"),
    ("POST", "/admin/workers/{proxy_id}/retire"),
    ("POST", "/rl/start_session"),
    ("POST", "/rl/set_reward"),
    ("POST", "/rl/end_session"),
    ("POST", "/rl/export_trajectories"),
    ("POST", "/export_trajectories"),
    ("POST", "/rl/ack_export"),
    ("GET", "/rl/sessions/{session_id}"),
}
AGENT_OPERATIONS = {
    ("POST", "/v1/sessions"),
    ("DELETE", "/v1/sessions/{session_id}"),
    ("GET", "/v1/sessions/{session_id}/history"),
    ("POST", "/v1/sessions/{session_id}/reward"),
    ("POST", "/v1/sessions/{session_id}/export"),
    ("POST", "/v1/sessions/{session_id}/ack_export"),
    ("POST", "/admin/pairs"),
    ("GET", "/admin/pairs"),
    ("DELETE", "/admin/pairs/{proxy_id}"),
    ("GET", "/admin/workers"),
} | AGENT_TURNS
# Of those, the ones whose body is optional (no body: every proxy / the defaults).
OPTIONAL_BODIES = {
    "/admin/pause",
    "/admin/continue",
    "/admin/workers/{proxy_id}/retire",
    "/rl/start_session",
    "/rl/end_session",
    "/rl/export_trajectories",
    "/export_trajectories",
    "/v1/sessions",
    "/v1/sessions/{session_id}/export",
}


def _app_routes(gw: RunningGateway) -> list[APIRoute]:
    """The typed routes the app was built with, and those that describe what is served
    outside FastAPI's routing (the fast path, plain routes)."""
    mode = gw.gateway.settings.mode
    routes = [r for router in api_routers(mode) for r in router.routes]
    routes += described_routes(mode)
    assert all(isinstance(r, APIRoute) for r in routes)
    return [r for r in routes if r.include_in_schema]


def _plain_routes(gw: RunningGateway) -> list[Route]:
    app = gw.server.config.app.app  # uvicorn serves the fast path, in front of the app
    return [r for r in app.routes if type(r) is Route]


def _operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}


def _fetch(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/openapi.json")  # no key: the document holds no secret
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    doc: dict[str, Any] = r.json()
    return doc


def _check_document(doc: dict[str, Any], gw: RunningGateway, expected: set) -> None:
    assert doc["openapi"].startswith("3.")
    routes = _app_routes(gw)
    declared = {(m, r.path) for r in routes for m in r.methods}
    assert _operations(doc) == declared == expected
    # Each documented operation is really served, key check first (401, not 404 or 400) ...
    with httpx.Client(base_url=gw.url) as c:
        for method, path in sorted(expected):
            url = path.replace("{name}", "m").replace("{proxy_id}", "p")
            url = url.replace("{response_id}", "resp_x")
            r = c.request(method, url.replace("{session_id}", "s"), content=b"{")
            if path.startswith("/v1/messages"):  # Anthropic's error shape
                assert r.status_code == 401 and r.json()["type"] == "error", r.text
            else:
                assert_error(r, 401, "missing_api_key")
    # ... and no JSON API hides among the plain (undocumented) routes.
    plain = {r.path for r in _plain_routes(gw)}
    assert plain <= {
        "/health",
        "/metrics",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/v1/models",
        "/models",
        "/v1/models/{name:path}",
        "/v1/responses",
        "/responses",
        "/v1/chat/completions",
        "/chat/completions",
    }, plain
    schemas = doc["components"]["schemas"]
    # FastAPI's 422 body is never sent: errors are OpenAI-shaped.
    assert "HTTPValidationError" not in schemas
    assert set(schemas["ErrorBody"]["properties"]) == {"error"}
    for route in routes:
        for method in route.methods:
            op = doc["paths"][route.path][method.lower()]
            assert op["security"] == [{"HTTPBearer": []}], route.path
            assert "4XX" in op["responses"] and "422" not in op["responses"]
            # The request schema is the model the route validates with.
            if route.body_field is None:
                assert "requestBody" not in op, route.path
            else:
                model = route.body_field.field_info.annotation
                assert isinstance(model, type) and issubclass(model, BaseModel)
                body = op["requestBody"]
                ref = body["content"]["application/json"]["schema"]["$ref"]
                assert ref == f"#/components/schemas/{model.__name__}", route.path
                assert body.get("required", False) == (route.path not in OPTIONAL_BODIES)
                assert set(schemas[model.__name__]["properties"]) == set(model.model_fields)
            # ... and the answer's, the model the endpoint's answer is checked against below.
            status = str(route.status_code or 200)
            model = route.response_model
            ref = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{model.__name__}", route.path


def _response_model(gw: RunningGateway, method: str, path: str) -> type[BaseModel]:
    for r in _app_routes(gw):
        if r.path == path and method in r.methods:
            model: type[BaseModel] = r.response_model
            return model
    raise AssertionError(f"no route {method} {path}")


def test_document_lists_exactly_the_served_json_apis(stack: Stack) -> None:
    doc = _fetch(stack.url)
    _check_document(doc, stack.gw, INFERENCE_OPERATIONS)
    reg = doc["components"]["schemas"]["RegisterModelRequest"]
    assert reg["required"] == ["name"]
    assert reg["properties"]["kind"]["enum"] == ["internal", "external"]
    group = doc["components"]["schemas"]["StartSessionRequest"]["properties"]["group_size"]
    assert (group["minimum"], group["maximum"], group["default"]) == (1, 1024, 1)
    export = doc["paths"]["/rl/export_trajectories"]["post"]["responses"]["200"]["content"]
    assert set(export) == {"application/json", "application/x-ndjson"}


def test_agent_mode_document(stack: Stack) -> None:
    gw = stack.start_gateway(mode="agent")
    _check_document(_fetch(gw.url), gw, AGENT_OPERATIONS)
    # A pair round trip, each answer in its declared shape.
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        pair = {"proxy_id": "pair-openapi", "address": stack.proxy_addrs["p0"]}
        r = c.post("/admin/pairs", json=pair)
        assert r.status_code == 201, r.text
        _response_model(gw, "POST", "/admin/pairs").model_validate(r.json())
        for path in ("/admin/pairs", "/admin/workers"):
            r = c.get(path)
            assert r.status_code == 200, r.text
            _response_model(gw, "GET", path).model_validate(r.json())
        r = c.delete("/admin/pairs/pair-openapi")
        _response_model(gw, "DELETE", "/admin/pairs/{proxy_id}").model_validate(r.json())
        assert_error(c.post("/admin/pairs", json={"proxy_id": " ", "address": "h:1"}), 400)
        r = c.post("/v1/sessions/s-1/reward", json={"reward": "high"})
        assert_error(r, 400, "invalid_type", "reward")
    # Another session's key is refused before its body is looked at.
    other = {"Authorization": f"Bearer {mint_key('agent-other')}"}
    r = httpx.post(gw.url + "/v1/sessions/s-1/reward", headers=other, json={"reward": "x"})
    assert_error(r, 403, "forbidden_session")


def test_document_and_docs_page_need_no_key(stack: Stack) -> None:
    doc = _fetch(stack.url)
    paths, schemas = doc["paths"], doc["components"]["schemas"]
    # The request bodies of the endpoints the fast path serves are described.
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/responses", "CreateResponseRequest"),
        ("/v1/messages", "MessagesRequest"),
        ("/v1/messages/count_tokens", "CountTokensRequest"),
    ):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}, path
    assert {"model", "messages"} <= set(schemas["ChatCompletionRequest"]["required"])
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is True
    assert schemas["CreateResponseRequest"]["additionalProperties"] is False
    assert "text/event-stream" in paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    deleted = paths["/v1/responses/{response_id}"]["delete"]["responses"]["200"]
    assert deleted["content"]["application/json"]["schema"]["$ref"].endswith("DeletedResponse")
    # A key changes nothing (no secret is held back from anyone).
    session = {"Authorization": f"Bearer {mint_key('sess-openapi')}"}
    # (fetched again: the examples' model is the catalog's, which this session's first
    # document may have been served before)
    doc = _fetch(stack.url)
    assert httpx.get(stack.url + "/openapi.json", headers=session).json() == doc
    # Swagger UI, its script and style served here (the page works without network).
    page = httpx.get(stack.url + "/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in page.text and "cdn." not in page.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert f"/docs/static/{asset}" in page.text
        r = httpx.get(stack.url + f"/docs/static/{asset}")
        assert r.status_code == 200 and len(r.content) > 10_000, asset
    assert_error(httpx.get(stack.url + "/redoc"), 404)


def test_described_bodies_are_the_parsers_own_fields() -> None:
    """The Responses and Messages bodies refuse what they do not list: the document lists
    exactly what the parsers accept."""
    from areal_gateway.anthropic import request as anthropic_request
    from areal_gateway.openai import shapes
    from areal_gateway.openai.responses import request as responses_request

    assert set(shapes.CreateResponseRequest.model_fields) == responses_request._KNOWN
    # What the Messages parser takes: acted on or changing nothing, and left out.
    taken = anthropic_request._KNOWN | set(anthropic_request._LEFT_OUT)
    assert set(shapes.MessagesRequest.model_fields) == taken
    assert set(shapes.CountTokensRequest.model_fields) == taken


def test_agent_mode_document_needs_no_key(stack: Stack) -> None:
    gw = stack.start_gateway(mode="agent")
    doc = _fetch(gw.url)
    turn = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert turn["schema"]["$ref"].endswith("AgentResponsesTurn")
    assert httpx.get(gw.url + "/docs").status_code == 200


def test_admin_answers_match_their_models(
    stack: Stack, http: httpx.Client, admin_headers: dict[str, str]
) -> None:
    gw = stack.gw
    body = {
        "name": "m-openapi",
        "proxies": [{"proxy_id": "m-openapi-0", "address": f" {stack.proxy_addrs['p0']} "}],
    }
    r = http.post("/admin/models", headers=admin_headers, json=body)
    assert r.status_code == 201, r.text
    created = _response_model(gw, "POST", "/admin/models").model_validate(r.json())
    # Kind defaults to internal; blanks around an address are dropped, as before.
    assert (
        created.kind == "internal"
        and r.json()["proxies"][0]["address"] == body["proxies"][0]["address"].strip()
    )
    r = http.post(
        "/admin/models/m-openapi/proxies",
        headers=admin_headers,
        json={"proxy_id": "m-openapi-1", "address": stack.proxy_addrs["p1"]},
    )
    assert r.status_code == 201, r.text
    _response_model(gw, "POST", "/admin/models/{name}/proxies").model_validate(r.json())
    for path in ("/admin/models", "/admin/workers"):
        r = http.get(path, headers=admin_headers)
        assert r.status_code == 200, r.text
        _response_model(gw, "GET", path).model_validate(r.json())
    # The fake proxies have no control RPCs: every worker fails, in the declared shape.
    r = http.post("/admin/pause", headers=admin_headers, json={"model": "m-openapi"})
    assert r.status_code >= 500, r.text
    result = _response_model(gw, "POST", "/admin/pause").model_validate(r.json())
    assert result.action == "pause" and result.version is None
    assert {w.proxy_id for w in result.workers} == {"m-openapi-0", "m-openapi-1"}
    assert all(w.error and w.paused is None for w in result.workers)
    r = http.delete("/admin/models/m-openapi", headers=admin_headers)
    assert r.status_code == 200, r.text
    _response_model(gw, "DELETE", "/admin/models/{name}").model_validate(r.json())


@pytest.mark.parametrize(
    "path, body, code, param",
    [
        (
            "/admin/models",
            {"name": "x", "kind": "internal", "proxies": [3]},
            "invalid_type",
            "proxies.0",
        ),
        ("/admin/models", {"name": 5}, "invalid_type", "name"),
        ("/admin/models", {"name": "   "}, "invalid_value", "name"),
        (
            "/admin/models",
            {"name": "x", "proxies": [{"proxy_id": "a", "address": "nohost"}]},
            "invalid_address",
            "proxies.0.address",
        ),
        (
            "/admin/models",
            {"name": "x", "proxies": [{"proxy_id": "a", "address": "h:1"}] * 2},
            "duplicate_proxy_id",
            "proxies",
        ),
        ("/admin/models/m/proxies", {"address": "h:1"}, "missing_required_parameter", "proxy_id"),
        ("/admin/set_version", {}, "missing_required_parameter", "version"),
        ("/admin/set_version", {"version": -1}, "invalid_value", "version"),
        ("/admin/set_version", {"version": "3"}, "invalid_type", "version"),
        ("/admin/set_version", {"version": True}, "invalid_type", "version"),
        ("/admin/update_weights", {"version": 2}, "missing_required_parameter", "path"),
        ("/admin/update_weights", {"path": ""}, "invalid_value", "path"),
        ("/admin/pause", {"model": 7}, "invalid_type", "model"),
        ("/rl/start_session", {"group_size": 0}, "invalid_value", "group_size"),
        ("/rl/start_session", {"group_size": 1025}, "invalid_value", "group_size"),
        ("/rl/start_session", {"group_size": 2.0}, "invalid_type", "group_size"),
        ("/rl/start_session", {"task_id": ["t"]}, "invalid_type", "task_id"),
        ("/rl/set_reward", {"session_id": "s"}, "missing_required_parameter", "reward"),
        ("/rl/set_reward", {"reward": "1"}, "invalid_type", "reward"),
        ("/rl/end_session", {"session_ids": [""]}, "invalid_value", "session_ids.0"),
        ("/rl/export_trajectories", {"style": "flat"}, "invalid_value", "style"),
        ("/rl/export_trajectories", {"discount": 1.5}, "invalid_value", "discount"),
        ("/rl/export_trajectories", {"remove_session": "yes"}, "invalid_type", "remove_session"),
        ("/export_trajectories", {"session_ids": "s"}, "invalid_type", "session_ids"),
        ("/rl/ack_export", {}, "missing_required_parameter", "export_id"),
        ("/rl/ack_export", {"export_id": ""}, "invalid_value", "export_id"),
    ],
)
def test_bad_bodies_get_openai_errors(
    http: httpx.Client, admin_headers: dict[str, str], path: str, body: Any, code: str, param: str
) -> None:
    err = assert_error(http.post(path, headers=admin_headers, json=body), 400, code, param)
    assert err["type"] == "invalid_request_error" and f"'{param}'" in err["message"]


@pytest.mark.parametrize(
    "export_id",
    ["exp-1", "exp-1.!!", "exp-1.e30", "sess-1.WyJzIl0", "exp-1." + "W10", "exp-1.WzFd"],
)
def test_an_ack_of_what_is_no_export_id_is_refused_before_routing(
    http: httpx.Client, admin_headers: dict[str, str], export_id: str
) -> None:
    # (no dot; not base64 JSON; an object; not an export; no route; a route that is no id)
    r = http.post("/rl/ack_export", headers=admin_headers, json={"export_id": export_id})
    assert_error(r, 400, "invalid_export_id", "export_id")


@pytest.mark.parametrize("path", ["/admin/models", "/admin/set_version", "/rl/set_reward"])
def test_auth_and_size_come_before_the_body(
    http: httpx.Client, admin_headers: dict[str, str], path: str
) -> None:
    bad = {"version": "x", "reward": "x", "name": 3}
    assert_error(http.post(path, json=bad), 401, "missing_api_key")
    assert_error(http.post(path, json=bad, headers={"Authorization": "Bearer nope"}), 401)
    session = {"Authorization": f"Bearer {mint_key('sess-order')}"}
    if path.startswith("/admin/"):
        assert_error(http.post(path, json=bad, headers=session), 403, "admin_key_required")
    h = {**admin_headers, "content-type": "application/json"}
    assert_error(http.post(path, headers=h, content=b"{"), 400, "invalid_json")
    assert_error(http.post(path, headers=h, content=b"[1]"), 400, "invalid_body")
    assert_error(http.post(path, headers=h, content=b""), 400, "invalid_json")
    # Too large by its declared length: refused before a byte of it is read. (A raw socket: an
    # HTTP client still sending the body may see the closed connection instead of the answer.)
    port = int(http.base_url.port or 0)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
        )
        answer = b""
        while chunk := s.recv(65536):  # the gateway closes the connection after a 413
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower(), head
    assert orjson.loads(body)["error"]["code"] == "body_too_large"


def test_bodies_are_json_whatever_their_content_type(
    http: httpx.Client, admin_headers: dict[str, str]
) -> None:
    # `curl -d` labels a JSON body as a form; the gateway always read bodies as JSON.
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
        h = {**admin_headers, **({"content-type": ctype} if ctype else {})}
        r = http.post("/admin/set_version", headers=h, content=b'{"version": 1, "worker": "nope"}')
        assert_error(r, 404, "worker_not_found", "worker")
    # An optional body may be absent or blank: pause everything (no worker matches here).
    for content in (b"", b"  \n"):
        r = http.post(
            "/admin/pause", headers=admin_headers, content=content + b"", params={"x": "1"}
        )
        assert r.status_code != 400, r.text


def test_unknown_fields_are_ignored(http: httpx.Client, admin_headers: dict[str, str]) -> None:
    r = http.post(
        "/admin/set_version",
        headers=admin_headers,
        json={"version": 1, "worker": "nope", "comment": "ignored"},
    )
    assert_error(r, 404, "worker_not_found")


def _example_of(doc: dict[str, Any], path: str) -> dict[str, Any]:
    body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[1]
    examples: list[dict[str, Any]] = doc["components"]["schemas"][name]["examples"]
    return examples[0]


def test_the_docs_examples_name_a_served_model_and_work(stack: Stack) -> None:
    # Swagger UI's "Try it out" sends the example body as it stands: its model must be one
    # the gateway serves (a placeholder such as "string" is a 404).
    from areal_gateway.openai.shapes import MODEL_EXAMPLE

    stack.register("m-docs-example")
    served = {m.name for m in stack.router.models.values()}
    headers = {"Authorization": f"Bearer {ADMIN_KEY}", "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=stack.url, timeout=10) as c:
        deadline = time.monotonic() + 5
        doc = c.get("/openapi.json").json()
        while MODEL_EXAMPLE in str(doc) and time.monotonic() < deadline:
            time.sleep(0.1)  # the catalog's first snapshot is on its way
            doc = c.get("/openapi.json").json()
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
            example = _example_of(doc, path)
            assert example["model"] in served, (path, example)
            # (this session's stack serves other tests' models too, some with no healthy
            # replica: the example's body is sent to the one registered here)
            r = c.post(path, json={**example, "model": "m-docs-example"}, headers=headers)
            assert r.status_code == 200, (path, r.text)
