"""What the admin API accepts as a model, and /rl/start_session without `model`.

It used to take a model with no proxies and any name; once one such model existed, every
`start_session` without `model` failed ("several models") for everyone.
"""

from __future__ import annotations

import httpx
import pytest
from conftest import ADMIN_KEY, Stack

from areal_proto.router.v1 import router_pb2


@pytest.mark.parametrize(
    "name",
    ["", " ", "a/b", "a b", "-lead", ".lead", "x" * 65, "naïve", "tab\there", "../x", "m?x"],
)
def test_names_the_cli_refuses_are_refused(
    stack: Stack, http: httpx.Client, admin_headers: dict[str, str], name: str
) -> None:
    proxies = [{"proxy_id": "n-0", "address": stack.proxy_addrs["p0"]}]
    r = http.post("/admin/models", headers=admin_headers, json={"name": name, "proxies": proxies})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "name" and err["type"] == "invalid_request_error"
    assert name.strip() not in stack.router.models or not name.strip()


@pytest.mark.parametrize("name", ["tiny", "Qwen2.5-7B", "a", "m_1.v2", "x" * 64])
def test_names_the_cli_accepts_are_accepted(
    stack: Stack, http: httpx.Client, admin_headers: dict[str, str], name: str
) -> None:
    proxies = [{"proxy_id": f"{name}-0", "address": stack.proxy_addrs["p0"]}]
    r = http.post("/admin/models", headers=admin_headers, json={"name": name, "proxies": proxies})
    assert r.status_code == 201, r.text
    assert http.delete(f"/admin/models/{name}", headers=admin_headers).status_code == 200


def test_an_internal_model_needs_a_proxy(
    stack: Stack, http: httpx.Client, admin_headers: dict[str, str]
) -> None:
    for body in ({"name": "m-empty"}, {"name": "m-empty", "proxies": []}):
        r = http.post("/admin/models", headers=admin_headers, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("proxies", "missing_required_parameter")
    assert "m-empty" not in stack.router.models


def test_start_session_without_model_ignores_models_nothing_serves(stack: Stack) -> None:
    # Its own router (one model served, one with no proxy), so other tests' models do not
    # count; start_session stops at the fake proxy (it has no StartSessions), after the pick.
    router = stack.router
    saved_models, saved_proxies = dict(router.models), dict(router.proxies)
    router.models.clear()
    router.proxies.clear()
    try:
        stack.register("m-served", ["p0"])
        router.models["m-hollow"] = router_pb2.ModelInfo(
            name="m-hollow", kind=router_pb2.MODEL_KIND_INTERNAL
        )
        gw = stack.start_gateway()
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=gw.url, timeout=10) as c:
            r = c.post("/rl/start_session", headers=headers, json={"task_id": "t"})
            # Not a 400 "several models are served": the hollow model is no candidate, and
            # the request went on to bind its group (which this fake router cannot do: 502).
            assert r.status_code != 400, r.text
            stack.register("m-served-2", ["p1"])
            r = c.post("/rl/start_session", headers=headers, json={"task_id": "t"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    finally:
        router.models.clear()
        router.proxies.clear()
        router.models.update(saved_models)
        router.proxies.update(saved_proxies)
