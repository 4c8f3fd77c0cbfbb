"""The RL API of an areal inference service, as a driver uses it (httpx + openai).

POST /rl/start_session      {task_id, group_size, model?}         admin key
    -> {group_id, sessions: [{session_id, session_api_key}]}
POST /v1/chat/completions   (OpenAI SDK)                          session key
POST /rl/set_reward         {reward}                              session key
POST /rl/export_trajectories {group_id, style, discount, remove_session}  admin key
    -> {"rows": [...]}  (rows as areal_proxy.recording.export builds them)
POST /admin/update_weights  {path}                                admin key
    -> pause, load, version + 1, continue
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import openai


class RLAPIError(RuntimeError):
    """A call to the inference service failed (one line: method, path, status, message)."""


@dataclass(frozen=True)
class Session:
    session_id: str
    session_api_key: str


@dataclass(frozen=True)
class Group:
    group_id: str
    task_id: str
    sessions: list[Session]


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message", err) if isinstance(err, dict) else err
    except ValueError:
        msg = resp.text
    return " ".join(str(msg).split())[:300]


class RLClient:
    def __init__(self, gateway_url: str, admin_api_key: str, timeout: float = 120.0) -> None:
        self.base = gateway_url.rstrip("/")
        self.admin_api_key = admin_api_key
        self.timeout = timeout
        # One connection pool for the admin calls and every session's chats.
        self.http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=64))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RLClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
        try:
            resp = self.http.post(
                self.base + path, json=body, headers={"Authorization": f"Bearer {key}"}
            )
        except httpx.HTTPError as e:
            raise RLAPIError(f"POST {path}: {type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            raise RLAPIError(f"POST {path}: HTTP {resp.status_code}: {_message(resp)}")
        return dict(resp.json()) if resp.content else {}

    # ---------------------------------------------------------------- RL API

    def start_session(self, task_id: str, group_size: int, model: str | None = None) -> Group:
        body: dict[str, Any] = {"task_id": task_id, "group_size": group_size}
        if model:
            body["model"] = model
        out = self._post("/rl/start_session", body, self.admin_api_key)
        sessions = [Session(s["session_id"], s["session_api_key"]) for s in out["sessions"]]
        if len(sessions) != group_size:
            raise RLAPIError(
                f"POST /rl/start_session: asked for {group_size} sessions, got {len(sessions)}"
            )
        return Group(out["group_id"], task_id, sessions)

    def chat(self, session: Session, model: str, **params: Any) -> Any:
        """One chat completion as this session (the proxy records it)."""
        client = openai.OpenAI(
            base_url=self.base + "/v1",
            api_key=session.session_api_key,
            http_client=self.http,
            max_retries=0,
            timeout=self.timeout,
        )
        try:
            return client.chat.completions.create(model=model, **params)
        except openai.APIError as e:
            raise RLAPIError(f"POST /v1/chat/completions: {type(e).__name__}: {e}") from None

    def set_reward(self, session: Session, reward: float) -> dict[str, Any]:
        return self._post("/rl/set_reward", {"reward": reward}, session.session_api_key)

    def export_trajectories(
        self,
        group_id: str,
        *,
        style: str = "individual",
        discount: float = 1.0,
        remove_session: bool = True,
    ) -> list[dict[str, Any]]:
        out = self._post(
            "/rl/export_trajectories",
            {
                "group_id": group_id,
                "style": style,
                "discount": discount,
                "remove_session": remove_session,
            },
            self.admin_api_key,
        )
        return list(out["rows"])

    # ---------------------------------------------------------------- admin API

    def update_weights(self, path: str) -> dict[str, Any]:
        return self._post("/admin/update_weights", {"path": path}, self.admin_api_key)

    def health(self) -> bool:
        try:
            return self.http.get(self.base + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


def version_of(reply: Any) -> int | None:
    """The highest `version` anywhere in an update_weights reply (one per replica)."""
    found: list[int] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "version" and isinstance(v, int) and not isinstance(v, bool):
                    found.append(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(reply)
    return max(found) if found else None
