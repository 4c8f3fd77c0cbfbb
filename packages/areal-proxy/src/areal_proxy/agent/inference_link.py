"""The link from an agent service to an areal inference service's RL API.

Every agent session gets an RL session there; the agent's LLM calls use that
session's key, so they are recorded; rewards and exports go through here.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from areal_runtime.errors import ServiceError


class InferenceLink:
    def __init__(self, gateway_url: str, admin_key: str, model: str = "") -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.base_url = self.gateway_url + "/v1"
        self.model = model
        self._admin = admin_key
        self._http: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def _post(self, path: str, body: dict[str, Any], key: str) -> Any:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        try:
            async with self._session().post(
                self.gateway_url + path, data=orjson.dumps(body), headers=headers
            ) as r:
                raw = await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ServiceError(
                503,
                f"inference service at {self.gateway_url} unreachable: {e}",
                code="inference_unavailable",
            ) from e
        data = orjson.loads(raw) if raw else {}
        if r.status >= 400:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            raise ServiceError(
                r.status if r.status < 500 else 502,
                f"inference service: {err.get('message', raw[:200])}",
                code=err.get("code") or "inference_error",
            )
        return data

    async def start_session(self, task_id: str) -> tuple[str, str]:
        body: dict[str, Any] = {"task_id": task_id, "group_size": 1}
        if self.model:
            body["model"] = self.model
        data = await self._post("/rl/start_session", body, self._admin)
        s = data["sessions"][0]
        return s["session_id"], s["session_api_key"]

    async def set_reward(
        self, session_key: str, reward: float, interaction_id: str = ""
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"reward": reward}
        if interaction_id:
            body["interaction_id"] = interaction_id
        return await self._post("/rl/set_reward", body, session_key)

    async def export(
        self, session_id: str, style: str, discount: float, remove: bool
    ) -> list[dict[str, Any]]:
        body = {
            "session_ids": [session_id],
            "style": style,
            "discount": discount,
            "remove_session": remove,
        }
        data = await self._post("/rl/export_trajectories", body, self._admin)
        return data["rows"] if isinstance(data, dict) else data

    async def end_session(self, session_key: str) -> None:
        await self._post("/rl/end_session", {}, session_key)
