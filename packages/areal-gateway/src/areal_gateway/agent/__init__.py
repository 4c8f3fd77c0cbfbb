"""The gateway's agent mode (`--mode agent`): sessions, turns, rewards and pairs.

Every route needs the admin key or a session key; `/health` and `/metrics` stay open.
The sessions and pairs APIs are FastAPI routes (in the OpenAPI document); the turns
(`/v1/responses`, `/v1/chat/completions`) are this mode's generation path, plain routes that
stream the agent's events; `/v1/models` lists the agent as the one model `agent`.
"""

from __future__ import annotations

from areal_gateway.agent import models, pairs, sessions, turns

routers = [sessions.router, pairs.router]
routes = [*turns.routes, *models.routes]
