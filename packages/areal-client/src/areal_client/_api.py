"""What each API call sends and how its answer is read, shared by the sync and async clients.

A client method builds a `Call` here and hands it to its transport (`httpx.Client` or
`httpx.AsyncClient`), which only moves bytes; so both clients send identical requests and
read answers identically, and a change to the API is made once.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from areal_client.errors import (
    APIConnectionError,
    APITimeoutError,
    ExportInterruptedError,
    InvalidResponseError,
    PartialFailureError,
    RateLimitError,
    status_error,
)
from areal_client.types import (
    ControlResult,
    ExportAck,
    ExportResult,
    ExportSelection,
    Group,
    ModelInfo,
    Reward,
    Session,
    SessionStatus,
    Trajectory,
    Worker,
    _get,
    _items,
)

# Long enough for update_weights, which pauses every engine and loads a checkpoint.
DEFAULT_TIMEOUT = 600.0
# Room for a rollout pool's concurrent calls (share it with the SDK: `http_client`).
DEFAULT_MAX_CONNECTIONS = 64


def admin_key_from(admin_api_key: str | None) -> str:
    key = admin_api_key or os.environ.get("AREAL_ADMIN_API_KEY", "")
    if not key:
        raise ValueError("admin_api_key is required (or set AREAL_ADMIN_API_KEY)")
    return key


T = TypeVar("T")

NDJSON = "application/x-ndjson"
# An NDJSON export with removal names the id to acknowledge here (areal_gateway.rl).
EXPORT_ID_HEADER = "x-areal-export-id"
# The gateway's own bound (areal_gateway.rl.MAX_GROUP_SIZE); checked here for a clear error.
MAX_GROUP_SIZE = 1024
STYLES = ("concat", "individual")
SIDE_CALLS = ("include", "exclude", "only")
# A session's failure reason: a short code (the proxy's rule, checked here first).
_FAILURE = re.compile(r"[a-z0-9_.:-]{1,64}")
CONTROL_ACTIONS = ("pause", "continue", "set_version", "update_weights")
# The gateway's bound on a start's wait for admission (StartSessionRequest.wait_s).
MAX_WAIT_S = 600.0
# What a start that waited still needs for itself (the gateway's router and proxy calls).
START_SLACK_S = 60.0


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    key: str | None  # the bearer: admin key, a session key, or None (health)
    parse: Callable[[Any, int], T]  # (JSON body, HTTP status) -> result
    body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # Seconds for this call instead of the client's timeout (a start that may wait).
    timeout: float | None = None

    def request_headers(self) -> dict[str, str]:
        out = dict(self.headers)
        if self.key:
            out["Authorization"] = f"Bearer {self.key}"
        if self.body is not None:
            out["Content-Type"] = "application/json"
        return out

    def content(self) -> bytes | None:
        return None if self.body is None else json.dumps(self.body).encode()


# The pause between admission retries, one name per flavour: gen_sync_client.py renames
# `async_sleep` to `sleep` in the generated sync client.
async_sleep = asyncio.sleep
sleep = time.sleep


def admission_pause(err: RateLimitError, left: float) -> float | None:
    """How long a start refused with `err` waits before it tries again, with `left`
    seconds of its deadline to go: the answer's Retry-After (1 s when it gave none), never
    past the deadline; None when the deadline has passed (the caller raises `err`)."""
    if left <= 0:
        return None
    return min(err.retry_after if err.retry_after is not None else 1.0, left)


def admission_wait(left: float) -> float:
    """The gateway-side wait (wait_s) of the next try, with `left` seconds to go."""
    return min(max(0.0, left), MAX_WAIT_S)


def transport_error(e: httpx.RequestError, call: Call[Any]) -> APIConnectionError:
    kind = APITimeoutError if isinstance(e, httpx.TimeoutException) else APIConnectionError
    detail = str(e) or type(e).__name__
    return kind(f"{type(e).__name__}: {detail}", method=call.method, path=call.path)


def decode(call: Call[T], status: int, raw: bytes, headers: httpx.Headers | None = None) -> T:
    """The result of a finished call, or its typed error."""
    if status >= 400:
        retry_after = headers.get("retry-after") if headers is not None else None
        raise status_error(status, raw, method=call.method, path=call.path, retry_after=retry_after)
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        raise InvalidResponseError(
            f"{call.method} {call.path}: HTTP {status} with a body that is not JSON: {raw[:200]!r}"
        ) from None
    return call.parse(doc, status)


def decode_line(line: str, index: int) -> Trajectory | None:
    """One NDJSON export line: a row, None for a blank line; an error line raises."""
    if not line.strip():
        return None
    try:
        doc = json.loads(line)
    except ValueError:
        raise InvalidResponseError(f"export line {index} is not JSON: {line[:200]!r}") from None
    if isinstance(doc, dict) and "error" in doc and "input_ids" not in doc:
        err = doc["error"] if isinstance(doc["error"], dict) else {"message": str(doc["error"])}
        raise ExportInterruptedError(
            str(err.get("message") or "unknown error"),
            code=err.get("code"),
            type=err.get("type"),
            rows_read=index,
        )
    return Trajectory.from_json(doc, index)


def _session_ref(session: Session | str, what: str) -> Session | str:
    if isinstance(session, Session):
        return session
    if isinstance(session, str) and session:
        return session
    raise ValueError(f"{what}: pass a Session, or a session id (acts with the admin key)")


class Requests:
    """Builds every call; holds the admin key and the gateway's base URL."""

    def __init__(self, base_url: str, admin_api_key: str) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if not isinstance(admin_api_key, str) or not admin_api_key:
            raise ValueError("admin_api_key must be a non-empty string")
        self.base_url = base_url.rstrip("/")
        self.admin = admin_api_key

    # -- service ----------------------------------------------------------------

    def health(self) -> Call[dict[str, Any]]:
        def parse(doc: Any, _: int) -> dict[str, Any]:
            if not isinstance(doc, dict):
                raise InvalidResponseError(f"/health: expected a JSON object, got {doc!r:.80}")
            return doc

        return Call("GET", "/health", None, parse)

    def served_models(self) -> Call[list[str]]:
        def parse(doc: Any, _: int) -> list[str]:
            return [
                _get(m, "id", str, f"/v1/models data[{i}]")
                for i, m in enumerate(_items(doc, "data", "/v1/models"))
            ]

        return Call("GET", "/v1/models", self.admin, parse)

    def list_models(self) -> Call[list[ModelInfo]]:
        def parse(doc: Any, _: int) -> list[ModelInfo]:
            return [
                ModelInfo.from_json(m, i) for i, m in enumerate(_items(doc, "models", "models"))
            ]

        return Call("GET", "/admin/models", self.admin, parse)

    def list_workers(self) -> Call[list[Worker]]:
        def parse(doc: Any, _: int) -> list[Worker]:
            return [Worker.from_json(w, i) for i, w in enumerate(_items(doc, "workers", "workers"))]

        return Call("GET", "/admin/workers", self.admin, parse)

    # -- RL API -----------------------------------------------------------------

    def start_group(
        self, task_id: str, group_size: int, model: str | None, wait_s: float = 0.0
    ) -> Call[Group]:
        if not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        if (
            isinstance(group_size, bool)
            or not isinstance(group_size, int)
            or not 1 <= group_size <= MAX_GROUP_SIZE
        ):
            raise ValueError(
                f"group_size must be an integer from 1 to {MAX_GROUP_SIZE}, got {group_size!r}"
            )
        if (
            isinstance(wait_s, bool)
            or not isinstance(wait_s, (int, float))
            or not 0 <= wait_s <= MAX_WAIT_S
        ):
            raise ValueError(
                f"wait_s must be a number of seconds from 0 to {MAX_WAIT_S:g}, got {wait_s!r}"
            )
        body: dict[str, Any] = {"task_id": task_id, "group_size": group_size}
        if model:
            body["model"] = model
        if wait_s:
            body["wait_s"] = float(wait_s)
        base = self.base_url

        def parse(doc: Any, _: int) -> Group:
            group = Group.from_json(doc, base)
            if len(group.sessions) != group_size:
                raise InvalidResponseError(
                    f"start_session: asked for {group_size} sessions, got {len(group.sessions)}"
                )
            return group

        # A start that may wait for admission gets the wait on top of a call's time.
        timeout = wait_s + START_SLACK_S if wait_s else None
        return Call("POST", "/rl/start_session", self.admin, parse, body, timeout=timeout)

    def set_reward(
        self, session: Session | str, reward: float, interaction_id: str | None
    ) -> Call[Reward]:
        ref = _session_ref(session, "set_reward")
        if (
            isinstance(reward, bool)
            or not isinstance(reward, (int, float))
            or not math.isfinite(reward)
        ):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        body: dict[str, Any] = {"reward": float(reward)}
        if interaction_id:
            body["interaction_id"] = interaction_id
        if isinstance(ref, Session):
            key = ref.api_key
        else:
            key, body["session_id"] = self.admin, ref
        return Call("POST", "/rl/set_reward", key, lambda doc, _: Reward.from_json(doc), body)

    def end_session(self, session: Session | str, failure: str | None = None) -> Call[int]:
        ref = _session_ref(session, "end_session")
        body: dict[str, Any]
        if isinstance(ref, Session):
            key, body = ref.api_key, {}
        else:
            key, body = self.admin, {"session_ids": [ref]}
        if failure is not None:
            if not isinstance(failure, str) or not _FAILURE.fullmatch(failure):
                raise ValueError(
                    f"failure must be a short code (1 to 64 of a-z 0-9 _ . : -), got {failure!r}"
                )
            body["failure"] = failure

        def parse(doc: Any, _: int) -> int:
            return int(_get(doc, "ended", int, "end_session"))

        return Call("POST", "/rl/end_session", key, parse, body)

    def session_status(self, session: Session | str) -> Call[SessionStatus]:
        ref = _session_ref(session, "session_status")
        if isinstance(ref, Session):
            key, sid = ref.api_key, ref.session_id
        else:
            key, sid = self.admin, ref
        path = "/rl/sessions/" + quote(sid, safe="")
        return Call("GET", path, key, lambda doc, _: SessionStatus.from_json(doc))

    def export(
        self,
        *,
        group_id: str | None,
        session_ids: list[str] | None,
        session: Session | None,
        style: str,
        discount: float,
        remove_session: bool,
        lines: bool = False,
        side_calls: str = "include",
        selection: ExportSelection | None = None,
    ) -> Call[ExportResult]:
        chosen = [x for x in (group_id, session_ids, session) if x]
        if len(chosen) != 1:
            raise ValueError("export: give exactly one of group_id, session_ids or session")
        if style not in STYLES:
            raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
        if side_calls not in SIDE_CALLS:
            raise ValueError(
                f"side_calls must be one of {', '.join(SIDE_CALLS)}, got {side_calls!r}"
            )
        if (
            isinstance(discount, bool)
            or not isinstance(discount, (int, float))
            or not 0.0 <= discount <= 1.0
        ):
            raise ValueError(f"discount must be a number from 0 to 1, got {discount!r}")
        if not isinstance(remove_session, bool):
            raise ValueError(f"remove_session must be a boolean, got {remove_session!r}")
        if selection is not None and not isinstance(selection, ExportSelection):
            raise ValueError(f"selection must be an ExportSelection, got {selection!r:.80}")
        body: dict[str, Any] = {
            "style": style,
            "side_calls": side_calls,
            "discount": float(discount),
            "remove_session": remove_session,
            **(selection.to_body() if selection is not None else {}),
        }
        key = self.admin
        if group_id:
            body["group_id"] = group_id
        elif session is not None:
            body["session_ids"] = [session.session_id]
            key = session.api_key
        else:
            ids = list(session_ids or [])
            if not all(isinstance(s, str) and s for s in ids):
                raise ValueError(f"session_ids must be non-empty strings, got {ids!r}")
            body["session_ids"] = ids
        headers = {"Accept": NDJSON} if lines else {}
        return Call(
            "POST",
            "/rl/export_trajectories",
            key,
            lambda doc, _: ExportResult.from_json(doc),
            body,
            headers,
        )

    def ack_export(self, export_id: str, key: str | None = None) -> Call[ExportAck]:
        """Remove what an export with removal read (`key`: the one it was made with)."""
        if not isinstance(export_id, str) or not export_id:
            raise ValueError(f"export_id must be a non-empty string, got {export_id!r}")
        return Call(
            "POST",
            "/rl/ack_export",
            key or self.admin,
            lambda doc, _: ExportAck.from_json(doc),
            {"export_id": export_id},
        )

    # -- generation control -----------------------------------------------------

    def control(
        self, action: str, body: dict[str, Any], model: str | None, worker: str | None
    ) -> Call[ControlResult]:
        if action not in CONTROL_ACTIONS:
            raise ValueError(f"unknown control action {action!r}")
        body = dict(body)
        if model:
            body["model"] = model
        if worker:
            body["worker"] = worker
        path = f"/admin/{action}"

        def parse(doc: Any, status: int) -> ControlResult:
            result = ControlResult.from_json(doc)
            if status == 207 or not result.ok:
                raise PartialFailureError(result, method="POST", path=path)
            return result

        return Call("POST", path, self.admin, parse, body)

    def set_version(
        self, version: int, model: str | None, worker: str | None
    ) -> Call[ControlResult]:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        return self.control("set_version", {"version": version}, model, worker)

    def update_weights(
        self, path: str, version: int | None, model: str | None, worker: str | None
    ) -> Call[ControlResult]:
        if not isinstance(path, str) or not path:
            raise ValueError(
                "update_weights: path must name a checkpoint folder the engines can read"
            )
        body: dict[str, Any] = {"path": path}
        if version is not None:
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ValueError(f"version must be an integer >= 0, got {version!r}")
            body["version"] = version
        return self.control("update_weights", body, model, worker)
