"""A multi-turn agent that keeps per-session state between turns."""

from __future__ import annotations


class CounterAgent:
    def __init__(self) -> None:
        self.turns: dict[str, int] = {}

    async def run(self, request, *, emitter):
        n = self.turns.get(request.session_id, 0) + 1
        self.turns[request.session_id] = n
        # The history areal keeps and the agent's own state must agree.
        assert len(request.history) == 2 * (n - 1), (len(request.history), n)
        await emitter.delta(f"turn {n}: {request.message_text}")
        return None

    async def close_session(self, session_id: str) -> None:
        self.turns.pop(session_id, None)
