"""The gateway's agent mode (`--mode agent`): sessions, turns, rewards and pairs.

Every route needs the admin key or a session key; `/health` and `/metrics` stay open.
"""

from __future__ import annotations

from areal_gateway.agent import pairs, sessions, turns

routes = [*sessions.routes, *turns.routes, *pairs.routes]
