"""Session lifecycle and the rules on what a session key may do.

Live sessions keep a small in-memory state (the lineage index, the next turn
number) in an LRU bounded by `max_live`; anything evicted is reloaded from
the store on its next use, so memory stays bounded while nothing is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from areal_proxy.recording import export
from areal_proxy.recording.lineage import Lineage
from areal_proxy.recording.model import Interaction, Session
from areal_proxy.recording.store import Store
from areal_runtime.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    SessionExists,
    SessionNotFound,
    Unauthenticated,
)
from areal_runtime.session_keys import key_hash, key_matches, new_id


@dataclass(slots=True)
class _Live:
    lineage: Lineage
    next_seq: int
    # Turns of one session are recorded in the order they finish; the lock
    # makes the seq assignment and the insert one step.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(slots=True)
class Turn:
    """What the proxy needs to know before generating a session's turn."""

    session: Session
    parent: Interaction | None
    # How many of the request's messages the parent's conversation covers.
    covered: int


class SessionBook:
    def __init__(
        self,
        store: Store,
        *,
        ttl: float = 3600.0,
        reward_finish_timeout: float = 0.0,
        max_live: int = 10_000,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.reward_finish_timeout = reward_finish_timeout
        self.max_live = max_live
        self._live: OrderedDict[str, _Live] = OrderedDict()

    # -- lifecycle ----------------------------------------------------------

    def start(self, group_id: str, task_id: str, model: str, creds: list[tuple[str, str]]) -> None:
        now = time.time()
        try:
            self.store.add_sessions(
                Session(sid, group_id, task_id, key_hash(key), model, now, now)
                for sid, key in creds
            )
        except Exception as e:  # sqlite3.IntegrityError: an id reused
            raise SessionExists(f"session already exists: {e}") from e

    def end(self, session_ids: list[str]) -> int:
        for sid in session_ids:
            self._live.pop(sid, None)
        return self.store.end_sessions(session_ids)

    def expire(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        ids = self.store.expire_idle(now - self.ttl, now)
        for sid in ids:
            self._live.pop(sid, None)
        return ids

    @property
    def live_count(self) -> int:
        return len(self._live)

    # -- authorization ------------------------------------------------------

    def authorize(self, session_id: str, key: str, *, for_turn: bool) -> Session:
        """The session `key` may act on, or a ServiceError (401/403/404/409)."""
        s = self.store.session(session_id)
        if s is None:
            raise SessionNotFound(f"session '{session_id}' not found")
        if not key_matches(key, s.key_hash):
            raise Unauthenticated("invalid session key", code="invalid_session_key")
        if s.ended_at is not None:
            raise Conflict(f"session '{session_id}' has ended", code="session_ended")
        if for_turn and self._closed_by_reward(s):
            raise Conflict(
                f"session '{session_id}' was closed by set_reward; start a new session for more turns",
                code="session_finished",
            )
        return s

    def _closed_by_reward(self, s: Session, now: float | None = None) -> bool:
        if s.last_reward_at is None:
            return False
        now = time.time() if now is None else now
        return now > s.last_reward_at + self.reward_finish_timeout

    # -- turns --------------------------------------------------------------

    def _state(self, session_id: str) -> _Live:
        live = self._live.get(session_id)
        if live is not None:
            self._live.move_to_end(session_id)
            return live
        lineage = Lineage()
        turns = self.store.interactions(session_id)
        for it in turns:
            if isinstance(it.messages, list) and isinstance(it.response, dict):
                lineage.add(it.interaction_id, it.messages, it.response)
        live = _Live(lineage, (turns[-1].seq + 1) if turns else 0)
        self._live[session_id] = live
        while len(self._live) > self.max_live:
            self._live.popitem(last=False)
        return live

    def begin_turn(self, session: Session, messages: list[dict[str, Any]] | None) -> Turn:
        if not messages:
            return Turn(session, None, 0)
        parent_id, covered = self._state(session.session_id).lineage.parent_of(messages)
        # One lookup by id: the cost of a turn does not grow with the session's history.
        parent = self.store.interaction(parent_id) if parent_id is not None else None
        return Turn(session, parent, covered)

    async def record(self, it: Interaction) -> Interaction:
        """Commit a finished interaction; returns it with its id and turn number."""
        live = self._state(it.session_id)
        async with live.lock:
            it.seq = live.next_seq
            if not it.interaction_id:
                it.interaction_id = new_id("int")
            self.store.add_interaction(it)
            live.next_seq += 1
            if isinstance(it.messages, list) and isinstance(it.response, dict):
                live.lineage.add(it.interaction_id, it.messages, it.response)
        return it

    # -- rewards and export -------------------------------------------------

    def set_reward(self, session: Session, interaction_id: str, reward: float) -> str:
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or reward != reward:
            raise InvalidRequest("reward must be a finite number", param="reward")
        iid = interaction_id or self.store.last_interaction_id(session.session_id)
        if iid is None:
            raise Conflict(
                f"session '{session.session_id}' has no interaction to reward yet",
                code="no_interaction",
            )
        if not self.store.set_reward(session.session_id, iid, float(reward), time.time()):
            raise NotFound(
                f"interaction '{iid}' not found in session '{session.session_id}'",
                code="interaction_not_found",
                param="interaction_id",
            )
        return iid

    def resolve_export(self, session_ids: list[str], group_id: str) -> list[Session]:
        if group_id:
            sessions = self.store.sessions_of_group(group_id)
            if not sessions:
                raise NotFound(f"group '{group_id}' not found", code="group_not_found")
            if session_ids:
                wanted = set(session_ids)
                sessions = [s for s in sessions if s.session_id in wanted]
            return sessions
        if not session_ids:
            raise InvalidRequest("give session_ids or group_id", param="session_ids")
        out = []
        for sid in session_ids:
            s = self.store.session(sid)
            if s is None:
                raise SessionNotFound(f"session '{sid}' not found")
            out.append(s)
        return out

    def export_rows(
        self, sessions: list[Session], style: str, discount: float
    ) -> Iterator[dict[str, Any]]:
        if style not in export.STYLES:
            raise InvalidRequest(f"style must be one of {', '.join(export.STYLES)}", param="style")
        if not 0.0 <= discount <= 1.0:
            raise InvalidRequest("discount must be between 0 and 1", param="discount")
        pairs = zip(
            sessions, self.store.iter_interactions([s.session_id for s in sessions]), strict=True
        )
        return export.rows(pairs, style, discount)

    def remove(self, sessions: list[Session]) -> None:
        ids = [s.session_id for s in sessions]
        for sid in ids:
            self._live.pop(sid, None)
        self.store.delete_sessions(ids)
