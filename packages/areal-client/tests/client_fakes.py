"""A fake gateway for httpx.MockTransport: canned answers per (method, path), every request kept.

The answers are shaped as packages/areal-gateway/src/areal_gateway/{rl,admin,control}.py
write them (docs/services.md), so the tests check the client against the documented API.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from areal_client.spans import prompt_hash

BASE = "http://gw.test:8080"
ADMIN = "admin-key"
SESSION_KEY = "areal-sk-sess-1.secret"


def row(i: int = 0, **over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "session_id": f"sess-{i}",
        "group_id": "group-1",
        "task_id": "t-1",
        "interaction_id": f"chatcmpl-{i}",
        "reward": float(i),
        "finish_reason": "stop",
        "input_ids": [1, 2, 3, 4],
        "loss_mask": [0, 0, 1, 1],
        "logprobs": [0.0, 0.0, -0.5, -0.25],
        "versions": [-1, -1, 3, 3],
        "interaction_ids": [f"chatcmpl-{i}"],
        "response_id": f"chatcmpl-{i}",
        "choice_index": 0,
        "replicas": [[2, "proxy-0"]],
        "chain_id": f"chatcmpl-{i}",
        "chain_reason": "root",
        "parent_chain": "",
        "side": False,
        "spans": [[2, 4, prompt_hash([1, 2])]],
        "tool_calls": {"declared": 1, "called": 1, "parsed": 1},
        "min_version": 3,
        "max_version": 3,
        "staleness": 0,
        "stale": False,
        "failure": "",
    }
    out.update(over)
    return out


def group_answer(n: int = 2, model: str = "tiny") -> dict[str, Any]:
    return {
        "group_id": "group-1",
        "task_id": "t-1",
        "model": model,
        "sessions": [
            {"session_id": f"sess-{i}", "session_api_key": f"areal-sk-sess-{i}.s{i}"}
            for i in range(n)
        ],
    }


def control_answer(action: str, *workers: dict[str, Any]) -> dict[str, Any]:
    ws = list(workers) or [
        {"proxy_id": "p0", "model": "tiny", "paused": False, "version": 4, "message": ""}
    ]
    versions = [w["version"] for w in ws if "version" in w]
    return {"action": action, "workers": ws, "version": max(versions) if versions else None}


def status_answer(sid: str = "sess-0", **over: Any) -> dict[str, Any]:
    """GET /rl/sessions/{id}, as rl.py passes on what the proxy's SessionBook.status makes."""
    out: dict[str, Any] = {
        "session_id": sid,
        "group_id": "group-1",
        "task_id": "t-1",
        "model": "tiny",
        "created_at": 1700000000.5,
        "last_active_at": 1700000009,
        "ended": False,
        "interactions": 4,
        "prompt": {
            "incremental": 2,
            "full": 2,
            "fallbacks": {"history_edited": 1},
            "cached": True,
            "last_prompt_tokens": 57,
        },
    }
    out.update(over)
    return out


Answer = httpx.Response | Callable[[httpx.Request], httpx.Response]

EXPORT_ID = "exp-1.WyJncm91cDpncm91cC0xIl0"


def export_answer(*rows: dict[str, Any]) -> Callable[[httpx.Request], httpx.Response]:
    """The JSON export, with an export_id when removal was asked (as rl.py answers)."""

    def answer(request: httpx.Request) -> httpx.Response:
        doc: dict[str, Any] = {"count": len(rows), "rows": list(rows)}
        if json.loads(request.content).get("remove_session"):
            doc["export_id"] = EXPORT_ID
        return httpx.Response(200, json=doc)

    return answer


def ack_answer(removed: list[str], kept: list[str] | None = None) -> dict[str, Any]:
    return {"export_id": EXPORT_ID, "removed": removed, "kept": kept or []}


@dataclass
class FakeGateway:
    answers: dict[tuple[str, str], Answer] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)

    def on(self, method: str, path: str, answer: Answer | Any, status: int = 200) -> None:
        if not isinstance(answer, httpx.Response) and not callable(answer):
            answer = httpx.Response(status, json=answer)
        self.answers[(method, path)] = answer

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.get((request.method, request.url.path))
        if answer is None:
            return httpx.Response(
                404, json={"error": {"message": "no route", "type": "x", "code": "no_route"}}
            )
        return answer(request) if callable(answer) else answer

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]

    def last_body(self) -> Any:
        return json.loads(self.last.content)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def bearer(request: httpx.Request) -> str:
    return request.headers["Authorization"].removeprefix("Bearer ")
