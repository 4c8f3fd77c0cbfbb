"""Agent sessions: created on first turn (or explicitly), history, idle timeout, close.

Turns of one session run one at a time, in arrival order (an asyncio.Lock is
FIFO). Memory is bounded by the idle timeout: an idle session is closed and
dropped with its history.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from areal_runtime.errors import PermissionDenied, SessionExists
from areal_runtime.session_keys import key_hash, key_matches

# Taken out of a new session's metadata: its own idle timeout in seconds, at most the
# proxy's. The gateway sets it on the session it makes for one admin turn
# (areal_gateway.agent.common.IDLE_TIMEOUT_KEY, the same string).
IDLE_TIMEOUT_KEY = "areal_idle_timeout_s"


@dataclass(slots=True)
class AgentSession:
    session_id: str
    key_hash: str
    metadata: dict[str, Any]
    created_at: float
    last_active_at: float
    history: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The linked RL session (inference service), if any.
    rl_session_id: str = ""
    rl_key: str = ""
    # This session's idle timeout; None = the proxy's.
    idle_timeout: float | None = None


class AgentSessions:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._by_id: dict[str, AgentSession] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def create(self, session_id: str, key: str, metadata: dict[str, Any]) -> AgentSession:
        if session_id in self._by_id:
            raise SessionExists(f"session '{session_id}' already exists")
        metadata = dict(metadata)
        ttl = metadata.pop(IDLE_TIMEOUT_KEY, None)
        now = time.time()
        s = AgentSession(session_id, key_hash(key) if key else "", metadata, now, now)
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl > 0:
            s.idle_timeout = min(float(ttl), self.timeout)
        self._by_id[session_id] = s
        return s

    def timeout_of(self, s: AgentSession) -> float:
        return self.timeout if s.idle_timeout is None else s.idle_timeout

    def get(self, session_id: str, key: str, *, is_admin: bool) -> AgentSession | None:
        s = self._by_id.get(session_id)
        if s is None:
            return None
        if not is_admin and not (s.key_hash and key_matches(key, s.key_hash)):
            raise PermissionDenied("this key may not act on that session", code="forbidden_session")
        s.last_active_at = time.time()
        return s

    def pop(self, session_id: str) -> AgentSession | None:
        return self._by_id.pop(session_id, None)

    def idle(self, now: float | None = None) -> list[AgentSession]:
        now = time.time() if now is None else now
        return [
            s
            for s in self._by_id.values()
            if not s.lock.locked() and now - s.last_active_at > self.timeout_of(s)
        ]
