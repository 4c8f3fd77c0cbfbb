"""The link from an agent service to an areal inference service's RL API.

Every agent session gets an RL session there; the agent's LLM calls use that
session's key, so they are recorded; rewards and exports go through here, over
`areal_client.AsyncArealClient` (the one client of the RL API). An export with removal is
not acknowledged here: the agent gateway's client acknowledges it (`ack_export`) once it has
the rows, so that no row is lost between here and there.

The agent servicer speaks `ServiceError`, so the client's errors are turned into
one here: a refused argument -> 400; unreachable or timed out -> 503 `inference_unavailable`; an error the
inference gateway answered keeps its code, a 5xx of its own becomes 502.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from areal_client import (
    APIConnectionError,
    APIStatusError,
    ArealClientError,
    AsyncArealClient,
    ExportAck,
    RateLimitError,
    Session,
)
from areal_runtime.errors import (
    InvalidRequest,
    ServiceError,
    Unavailable,
    UpstreamError,
    error_for,
)
from areal_runtime.session_keys import session_of

# One call is a start/reward/export on an idle inference gateway: a minute is an outage.
LINK_TIMEOUT_S = 60.0


class Exported(NamedTuple):
    rows: list[dict[str, Any]]
    # With removal: the inference gateway's id to acknowledge (`ack_export`); else "".
    export_id: str


class InferenceLink:
    def __init__(self, gateway_url: str, admin_key: str, model: str = "") -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.base_url = self.gateway_url + "/v1"
        self.model = model
        self._client = AsyncArealClient(self.gateway_url, admin_key, timeout=LINK_TIMEOUT_S)

    async def close(self) -> None:
        await self._client.aclose()

    def _error(self, e: ArealClientError | ValueError) -> ServiceError:
        if isinstance(e, ValueError):  # the client refused an argument before sending it
            return InvalidRequest(str(e), code="invalid_value")
        if isinstance(e, APIConnectionError):
            return Unavailable(
                f"inference service at {self.gateway_url} unreachable: {e.message}",
                code="inference_unavailable",
            )
        if isinstance(e, APIStatusError):
            # The inference gateway's own error keeps its class (a session it does not know
            # is a SessionNotFound here too); its server failures are a bad gateway here.
            err = error_for(
                e.status if e.status < 500 else 502,
                f"inference service: {e.message}",
                code=e.code or "inference_error",
            )
            if isinstance(e, RateLimitError) and e.retry_after:
                # The inference service's admission control refused the session: the agent
                # gateway answers its Retry-After too.
                err.retry_after_s = max(1, math.ceil(e.retry_after))
            return err
        return UpstreamError(f"inference service: {e}", code="inference_error")

    def _session(self, session_key: str) -> Session:
        # The agent side keeps the key; the id is read out of it (`areal-sk-<id>.<secret>`).
        return Session(session_of(session_key) or "", session_key, "", self.gateway_url)

    async def start_session(self, task_id: str) -> tuple[str, str]:
        try:
            s = await self._client.start_session(task_id, self.model or None)
        except (ArealClientError, ValueError) as e:
            raise self._error(e) from e
        return s.session_id, s.api_key

    async def set_reward(
        self, session_key: str, reward: float, interaction_id: str = ""
    ) -> dict[str, Any]:
        try:
            out = await self._client.set_reward(
                self._session(session_key), reward, interaction_id=interaction_id or None
            )
        except (ArealClientError, ValueError) as e:
            raise self._error(e) from e
        return {
            "session_id": out.session_id,
            "interaction_id": out.interaction_id,
            "reward": out.reward,
        }

    async def export(
        self,
        session_id: str,
        style: str,
        discount: float,
        remove: bool,
        side_calls: str = "include",
    ) -> Exported:
        """The RL session's rows. With `remove` nothing is removed here: the rows still have
        to reach the agent gateway's client, so the export is not acknowledged; its
        `export_id` goes back with the rows, and `ack_export` removes them once that client
        has them (until then another export returns the same rows)."""
        try:
            result = await self._client.export(
                session_ids=[session_id],
                style=style,
                side_calls=side_calls,
                discount=discount,
                remove_session=remove,
                acknowledge=False,
            )
        except (ArealClientError, ValueError) as e:
            raise self._error(e) from e
        return Exported([row.to_dict() for row in result.rows], result.export_id or "")

    async def ack_export(self, session_key: str, export_id: str) -> ExportAck:
        """Acknowledge an export with removal of the RL session `session_key` holds, with that
        key: the inference gateway removes only that session (a session key may acknowledge
        only its own session's export). Idempotent there."""
        try:
            return await self._client.ack_export(export_id, session=self._session(session_key))
        except (ArealClientError, ValueError) as e:
            raise self._error(e) from e

    async def end_session(self, session_key: str) -> None:
        try:
            await self._client.end_session(self._session(session_key))
        except (ArealClientError, ValueError) as e:
            raise self._error(e) from e
