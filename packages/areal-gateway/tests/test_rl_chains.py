"""Side calls and chains through the gateway: the `x-areal-call` header reaches the proxy in
the envelope (or is refused naming itself), and `/rl/export_trajectories` asks the proxy for
one row per chain by default and for the side calls the trainer chose."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from conftest import Stack
from test_errors import assert_error

from areal_gateway.schemas import TrajectoryRow

MODEL = "m-chains"
SID = "sess-chains-a"
ROW: dict[str, Any] = {
    "input_ids": [1, 2, 3],
    "loss_mask": [0, 1, 1],
    "logprobs": [0.0, -0.5, -0.25],
    "versions": [-1, 0, 0],
    "reward": 1.0,
    "session_id": SID,
    "group_id": "g",
    "task_id": "t",
    "interaction_id": "i",
    "interaction_ids": ["i"],
    "response_id": "i",
    "choice_index": 0,
    "replicas": [[1, "p1"]],
    "finish_reason": "stop",
    "chain_id": "i",
    "chain_reason": "root",
    "parent_chain": "",
    "side": True,
    "spans": [[1, 3, "ab" * 16]],
    "tool_calls": {"declared": 0, "called": 0, "parsed": 0},
    "min_version": 0,
    "max_version": 0,
    "staleness": 0,
    "stale": False,
    "failure": "",
}


@pytest.fixture
def held(stack: Stack) -> Any:
    stack.register(MODEL)
    proxy = stack.proxies["p1"]
    stack.router.pins[SID] = f"{MODEL}-p1"
    proxy.rows[SID] = [ROW]
    yield proxy
    stack.router.pins.pop(SID, None)
    proxy.rows.pop(SID, None)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a title?"}]}),
        ("/v1/completions", {"prompt": "x"}),
    ],
)
@pytest.mark.parametrize(("header", "kind"), [(None, ""), ("side", "side"), ("Main", "main")])
def test_the_call_header_reaches_the_proxy(
    stack: Stack, admin_headers: dict[str, str], path: str, body: dict[str, Any], header, kind
) -> None:
    stack.register(MODEL)
    rid = "req-" + uuid.uuid4().hex
    headers = {**admin_headers, "x-request-id": rid}
    if header is not None:
        headers["x-areal-call"] = header
    r = httpx.post(stack.url + path, json={"model": MODEL, **body}, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert stack.find(rid).envelope.call_kind == kind


def test_an_unknown_call_kind_is_refused_naming_the_header(
    stack: Stack, admin_headers: dict[str, str]
) -> None:
    stack.register(MODEL)
    r = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers={**admin_headers, "x-areal-call": "title"},
        timeout=10,
    )
    err = assert_error(r, 400, "invalid_value", "x-areal-call")
    assert "'side' or 'main'" in err["message"]


def test_the_export_asks_for_chains_and_every_side_call_by_default(
    stack: Stack, admin_headers: dict[str, str], held: Any
) -> None:
    r = httpx.post(
        stack.url + "/rl/export_trajectories",
        json={"session_ids": [SID]},
        headers=admin_headers,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 1, "rows": [ROW]}
    TrajectoryRow.model_validate(ROW)
    got = held.exports[-1]
    assert (got.style, got.side_calls) == ("concat", "include")


@pytest.mark.parametrize("side_calls", ["exclude", "only"])
def test_the_export_passes_the_trainers_choice_on(
    stack: Stack, admin_headers: dict[str, str], held: Any, side_calls: str
) -> None:
    r = httpx.post(
        stack.url + "/rl/export_trajectories",
        json={"session_ids": [SID], "side_calls": side_calls, "style": "individual"},
        headers=admin_headers,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    got = held.exports[-1]
    assert (got.style, got.side_calls) == ("individual", side_calls)


def test_an_unknown_side_calls_choice_is_refused(
    stack: Stack, admin_headers: dict[str, str], held: Any
) -> None:
    before = len(held.exports)
    r = httpx.post(
        stack.url + "/rl/export_trajectories",
        json={"session_ids": [SID], "side_calls": "some"},
        headers=admin_headers,
        timeout=10,
    )
    assert_error(r, 400, "invalid_value", "side_calls")
    assert len(held.exports) == before
