"""A typed Python client for an areal inference service's RL and admin APIs.

    from areal_gateway.client import ArealClient

    with ArealClient("http://127.0.0.1:8080", admin_api_key="...") as areal:
        group = areal.start_group(task_id="q-17", group_size=4)
        for s in group.sessions:
            llm = s.openai()                      # an openai.OpenAI bound to the session key
            r = llm.chat.completions.create(model=group.model, messages=[...])
            areal.set_reward(s, reward=1.0)       # the session's last interaction
        rows = areal.export(group_id=group.group_id, remove_session=True)
        areal.update_weights("/ckpt/step-10")     # pause -> load -> version + 1 -> continue

Errors come back as `ArealError` with the HTTP status and the OpenAI-shaped error fields.
It needs only httpx; `Session.openai()` needs the `openai` package (`areal-gateway[client]`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson


class ArealError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "", code: str = "") -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.code = code


@dataclass(frozen=True)
class Session:
    session_id: str
    api_key: str
    group_id: str
    base_url: str

    def openai(self, **kwargs: Any) -> Any:
        """An `openai.OpenAI` client whose calls are recorded on this session."""
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, **kwargs)

    def async_openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, **kwargs)


@dataclass(frozen=True)
class Group:
    group_id: str
    task_id: str
    model: str
    sessions: list[Session]


@dataclass(frozen=True)
class WorkerControl:
    proxy_id: str
    model: str
    paused: bool | None
    version: int | None
    message: str


def _raise_for(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        err = r.json().get("error", {})
    except ValueError:
        err = {}
    raise ArealError(
        r.status_code,
        err.get("message") or r.text[:300],
        type=err.get("type") or "",
        code=err.get("code") or "",
    )


class ArealClient:
    def __init__(self, base_url: str, admin_api_key: str, *, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._admin = admin_api_key
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def __enter__(self) -> ArealClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any], key: str | None = None) -> Any:
        r = self._http.post(
            path,
            content=orjson.dumps(body),
            headers={
                "Authorization": f"Bearer {key or self._admin}",
                "Content-Type": "application/json",
            },
        )
        _raise_for(r)
        return r.json()

    # -- service -------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        r = self._http.get("/health")
        _raise_for(r)
        return r.json()

    def models(self) -> list[str]:
        r = self._http.get("/v1/models", headers={"Authorization": f"Bearer {self._admin}"})
        _raise_for(r)
        return [m["id"] for m in r.json()["data"]]

    # -- sessions, rewards, trajectories ----------------------------------------

    def start_group(
        self, task_id: str = "", group_size: int = 1, model: str | None = None
    ) -> Group:
        body: dict[str, Any] = {"task_id": task_id, "group_size": group_size}
        if model:
            body["model"] = model
        out = self._post("/rl/start_session", body)
        sessions = [
            Session(s["session_id"], s["session_api_key"], out["group_id"], self.base_url)
            for s in out["sessions"]
        ]
        return Group(out["group_id"], out["task_id"], out["model"], sessions)

    def set_reward(self, session: Session, reward: float, interaction_id: str | None = None) -> str:
        """Reward a session's interaction (its last one by default); returns the interaction id."""
        body: dict[str, Any] = {"reward": reward}
        if interaction_id:
            body["interaction_id"] = interaction_id
        return str(self._post("/rl/set_reward", body, key=session.api_key)["interaction_id"])

    def end_session(self, session: Session) -> None:
        self._post("/rl/end_session", {}, key=session.api_key)

    def export(
        self,
        *,
        group_id: str = "",
        session_ids: list[str] | None = None,
        style: str = "individual",
        discount: float = 1.0,
        remove_session: bool = False,
    ) -> list[dict[str, Any]]:
        """Trajectory rows: input_ids, loss_mask, logprobs, versions, reward, and their ids."""
        body = self._export_body(group_id, session_ids, style, discount, remove_session)
        return list(self._post("/rl/export_trajectories", body)["rows"])

    def iter_export(
        self,
        *,
        group_id: str = "",
        session_ids: list[str] | None = None,
        style: str = "individual",
        discount: float = 1.0,
        remove_session: bool = False,
    ) -> Iterator[dict[str, Any]]:
        """The same rows, streamed as JSON lines (for exports too large to hold at once)."""
        body = self._export_body(group_id, session_ids, style, discount, remove_session)
        headers = {"Authorization": f"Bearer {self._admin}", "Accept": "application/x-ndjson"}
        with self._http.stream("POST", "/rl/export_trajectories", json=body, headers=headers) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for(r)
            for line in r.iter_lines():
                if not line:
                    continue
                row = orjson.loads(line)
                if "error" in row and "input_ids" not in row:
                    err = row["error"]
                    raise ArealError(
                        502,
                        err.get("message", ""),
                        type=err.get("type", ""),
                        code=err.get("code", ""),
                    )
                yield row

    @staticmethod
    def _export_body(
        group_id: str, session_ids: list[str] | None, style: str, discount: float, remove: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"style": style, "discount": discount, "remove_session": remove}
        if group_id:
            body["group_id"] = group_id
        if session_ids:
            body["session_ids"] = session_ids
        return body

    # -- generation control ------------------------------------------------------

    def _control(
        self, action: str, body: dict[str, Any], model: str | None, worker: str | None
    ) -> list[WorkerControl]:
        if model:
            body["model"] = model
        if worker:
            body["worker"] = worker
        out = self._post(f"/admin/{action}", body)
        return [
            WorkerControl(
                w["proxy_id"],
                w["model"],
                w.get("paused"),
                w.get("version"),
                w.get("message", w.get("error", "")),
            )
            for w in out["workers"]
        ]

    def pause(self, *, model: str | None = None, worker: str | None = None) -> list[WorkerControl]:
        return self._control("pause", {}, model, worker)

    def resume(self, *, model: str | None = None, worker: str | None = None) -> list[WorkerControl]:
        return self._control("continue", {}, model, worker)

    def set_version(
        self, version: int, *, model: str | None = None, worker: str | None = None
    ) -> list[WorkerControl]:
        return self._control("set_version", {"version": version}, model, worker)

    def update_weights(
        self,
        path: str,
        *,
        version: int | None = None,
        model: str | None = None,
        worker: str | None = None,
    ) -> int:
        """Load a checkpoint on every (matching) engine; returns the new weight version."""
        body: dict[str, Any] = {"path": path}
        if version is not None:
            body["version"] = version
        results = self._control("update_weights", body, model, worker)
        return max(w.version for w in results if w.version is not None)
