"""Session lifecycle and the rules on what a session key may do.

Live sessions keep a small in-memory state (the lineage index, the next turn
number) in an LRU bounded by `max_live`; anything evicted is reloaded from
the store on its next use, so memory stays bounded while nothing is lost.

Every method is synchronous and touches SQLite; the proxy runs them through `call`, on
one dedicated thread (`executor`), never on the event loop that serves streams, health and
GetStats: a slow statement (a big row, a busy disk) then delays only other recording work.
One thread also keeps the one connection's transactions in order (two threads interleaving
BEGIN/COMMIT on a connection would mix their statements), and each method holds the book's
lock while it runs, so it is atomic with respect to the others and a turn's seq assignment
and insert need nothing more.

Two exceptions run on the caller's thread (the event loop) when the lock is free at once,
each saving the two thread hops of `call` (about 0.1 ms of CPU per turn):
- `begin_known` (`try_now`), the start of a small turn of a session whose state is all in
  memory. It reads no SQLite, so it cannot wait for a disk; anything it would have to read
  falls back to the thread.
- the commit of a small turn (`try_write_now`): an insert of a few kB into the WAL, which
  syncs nothing (synchronous=NORMAL) and never checkpoints (checkpoints run on the thread,
  `Store.manual_checkpoints`). A write that still took long (a disk the kernel throttles)
  sends every write to the thread for the next `_SLOW_WRITE_PAUSE_S`: a sick disk stalls the
  loop once, not on every turn.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from areal_proxy.common.records import Interaction, Session
from areal_proxy.prompt.incremental import Previous
from areal_proxy.prompt.state import CachedTurn, PromptState, TurnCache
from areal_proxy.recording import export, selection
from areal_proxy.recording.lineage import Lineage
from areal_proxy.recording.selection import Policy, Summary
from areal_proxy.recording.spans import pack_ids, prompt_hasher
from areal_proxy.recording.store import Store
from areal_runtime.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    ReplicaDataLost,
    SessionExists,
    SessionNotFound,
    StorageFull,
    Unauthenticated,
)
from areal_runtime.openai.messages import canonical
from areal_runtime.session_keys import key_hash, key_matches, new_id

_T = TypeVar("_T")
log = logging.getLogger(__name__)

# An inline write (`try_write_now`) slower than this sends writes to the recording thread
# for the next `_SLOW_WRITE_PAUSE_S`.
_SLOW_WRITE_S = 0.005
_SLOW_WRITE_PAUSE_S = 30.0
# A failure reason: a short code, not free text (it is a row field and a summary key).
_FAILURE = re.compile(r"[a-z0-9_.:-]{1,64}")


@dataclass(slots=True)
class _Live:
    lineage: Lineage
    # Turns of one session are recorded in the order they finish (`record` assigns it).
    next_seq: int
    # The latest turn's id and a prompt hasher fed its prompt + output ids: the next turn that
    # continues them hashes only its own ids (`_hash_prompt`).
    hashed: tuple[str, Any] | None = None


@dataclass(slots=True)
class Turn:
    """What the proxy needs to know before generating a session's turn."""

    session: Session
    parent: Interaction | None
    # How many of the request's messages the parent's conversation covers.
    covered: int
    # The hash of all the request's messages (the lineage indexes the answer after it).
    messages_hash: bytes = b""
    # What prompt building may continue from (prompt/incremental.py).
    previous: Previous | None = None


class SessionBook:
    def __init__(
        self,
        store: Store,
        *,
        ttl: float = 3600.0,
        reward_finish_timeout: float = 0.0,
        max_live: int = 10_000,
        executor: Executor | None = None,
        turn_cache_bytes: int = 512 << 20,
        retention: float = 0.0,
        lost_data: str = "",
        proxy_id: str = "",
    ) -> None:
        self.store = store
        # This proxy's id (--proxy-id; "proxy" when it has none): the recording proxy named in
        # the rows as the replica of the tokens its own engine made (Interaction.replicas).
        self.proxy_id = proxy_id or "proxy"
        # Why a session may be unknown here beyond a typo: this replica lost what it recorded.
        self.lost_data = lost_data
        self.ttl = ttl
        # Seconds an ended, exported session's records are kept before `purge` deletes them
        # (0: kept until an export asks for their removal).
        self.retention = retention
        self.reward_finish_timeout = reward_finish_timeout
        self.max_live = max_live
        self.executor = executor
        self._live: OrderedDict[str, _Live] = OrderedDict()
        # The last turns of live sessions, whole, with their prompt states: a turn's parent
        # is taken from here rather than rebuilt from SQLite (prompt/state.py).
        self.turns = TurnCache(turn_cache_bytes)
        # Sessions not ended, for GetStats: kept here so a stats poll reads no SQLite (it
        # must answer at once, whatever the recording thread is doing).
        self.live_sessions = store.live_session_count()
        # Held by whatever runs a method: the recording thread, or `try_now`.
        self._lock = threading.Lock()
        # With a recording thread, SQLite checkpoints there only (after its jobs), so that
        # an inline commit never runs one; no write runs inline before this (monotonic).
        self._inline_writes_from = 0.0
        if executor is not None:
            store.manual_checkpoints()

    async def call(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
        """`fn(*args, **kwargs)` on the recording thread (inline when there is none)."""
        if self.executor is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, functools.partial(self._locked, fn, *args, **kwargs)
        )

    def _locked(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            try:
                return fn(*args, **kwargs)
            finally:
                if self.store.checkpoint_due:
                    self._checkpoint()

    def _checkpoint(self) -> None:
        try:
            self.store.checkpoint()
        except sqlite3.Error as e:  # the next one tries again; the WAL only grows meanwhile
            log.warning("WAL checkpoint failed: %r", e)

    def try_write_now(self, session_id: str, fn: Callable[..., _T], /, *args: Any) -> _T | None:
        """`try_now` for a method that writes a turn of a live session (a small turn's
        commit: `record_now` then reads nothing); None, and nothing run, if another method
        is running, the session is not live, or inline writes are paused after a slow one."""
        if self.executor is None or time.monotonic() < self._inline_writes_from:
            return None
        if not self._lock.acquire(blocking=False):
            return None
        if session_id not in self._live:
            self._lock.release()
            return None
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._lock.release()
            took = time.perf_counter() - t0
            if took > _SLOW_WRITE_S:
                self._inline_writes_from = time.monotonic() + _SLOW_WRITE_PAUSE_S
                log.warning(
                    "a recording write took %.0f ms on the event loop: writes go to the "
                    "recording thread for %gs",
                    took * 1e3,
                    _SLOW_WRITE_PAUSE_S,
                )
            if self.store.checkpoint_due:
                try:  # the thread checkpoints after it runs this
                    self.executor.submit(self._locked, _nothing)
                except RuntimeError:  # shut down: the database closes soon
                    pass

    def try_now(self, fn: Callable[..., _T | None], /, *args: Any) -> _T | None:
        """`fn(*args)` here and now if no other method is running (None if one is): for `fn`
        that read no SQLite and return None where they would have to (`begin_known`)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return fn(*args)
        finally:
            self._lock.release()

    def _count_live(self) -> None:
        self.live_sessions = self.store.live_session_count()

    # -- lifecycle ----------------------------------------------------------

    def start(self, group_id: str, task_id: str, model: str, creds: list[tuple[str, str]]) -> None:
        now = time.time()
        try:
            self.store.add_sessions(
                Session(sid, group_id, task_id, key_hash(key), model, now, now)
                for sid, key in creds
            )
        except sqlite3.IntegrityError as e:  # an id reused; any other failure is not that
            raise SessionExists(f"session already exists: {e}") from e
        self._count_live()

    def end(self, session_ids: list[str], failure: str = "") -> int:
        """End sessions; with `failure`, record why they failed (also on sessions already
        ended, unless a failure is recorded there already). Returns how many were ended."""
        if failure and not _FAILURE.fullmatch(failure):
            raise InvalidRequest(
                "failure must be a short code: 1 to 64 of a-z, 0-9, '_', '-', '.', ':'",
                param="failure",
            )
        for sid in session_ids:
            self._live.pop(sid, None)
        self.turns.drop(session_ids)
        ended = self.store.end_sessions(session_ids)
        if failure:
            self.store.fail_sessions(session_ids, failure)
        self._count_live()
        return ended

    def expire(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        ids = self.store.expire_idle(now - self.ttl, now)
        for sid in ids:
            self._live.pop(sid, None)
        self.turns.drop(ids)
        if ids:
            self._count_live()
        return ids

    def purge(self, now: float | None = None) -> list[str]:
        """Delete the sessions ended and exported more than `retention` seconds ago."""
        if self.retention <= 0:
            return []
        now = time.time() if now is None else now
        ids = self.store.purgeable(now - self.retention)
        if ids:
            self.remove_ids(ids)
        return ids

    def exported(self, sessions: list[Session]) -> None:
        """Every row of `sessions` was handed to a trainer: retention starts. Bookkeeping
        only: on a full disk the export still succeeds (its rows were sent), and retention
        starts at the next export."""
        try:
            self.store.mark_exported([s.session_id for s in sessions])
        except StorageFull as e:
            log.warning("export not marked (retention not started): %s", e.message)

    @property
    def live_count(self) -> int:
        return len(self._live)

    # -- authorization ------------------------------------------------------

    def missing(self, session_id: str) -> SessionNotFound:
        """The error for a session this proxy does not know."""
        if self.lost_data:
            return ReplicaDataLost(f"session '{session_id}' not found: {self.lost_data}")
        return SessionNotFound(f"session '{session_id}' not found")

    def authorize(self, session_id: str, key: str, *, for_turn: bool) -> Session:
        """The session `key` may act on, or a ServiceError (401/403/404/409)."""
        s = self.store.session(session_id)
        if s is None:
            raise self.missing(session_id)
        # Its next turn checks the key without reading the row again (`begin_known`).
        self.store.remember(s)
        return self._check(s, key, for_turn=for_turn)

    def _check(self, s: Session, key: str, *, for_turn: bool) -> Session:
        session_id = s.session_id
        if not key_matches(key, s.key_hash):
            raise Unauthenticated("invalid session key", code="invalid_session_key")
        if s.ended_at is not None:
            raise Conflict(f"session '{session_id}' has ended", code="session_ended")
        if for_turn and self._closed_by_reward(s):
            raise self._finished(session_id)
        return s

    @staticmethod
    def _finished(session_id: str) -> Conflict:
        return Conflict(
            f"session '{session_id}' was closed by set_reward; start a new session for more turns",
            code="session_finished",
        )

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
        turns = self.store.conversations(session_id)
        for iid, _, messages, response in turns:
            if isinstance(messages, list) and isinstance(response, dict):
                lineage.add(iid, messages, response)
        live = _Live(lineage, (turns[-1][1] + 1) if turns else 0)
        self._live[session_id] = live
        while len(self._live) > self.max_live:
            self._live.popitem(last=False)
        return live

    def begin_known(
        self, session_id: str, key: str, messages: list[dict[str, Any]] | None
    ) -> Turn | None:
        """`authorize` and `begin_turn` from memory alone: None where they would read SQLite
        (a session not remembered or not live, a parent not cached), before changing
        anything. Raises what `authorize` raises."""
        s = self.store.known_session(session_id)
        if s is None or (messages and session_id not in self._live):
            return None
        return self._begin_turn(self._check(s, key, for_turn=True), messages, known_only=True)

    def begin_turn(self, session: Session, messages: list[dict[str, Any]] | None) -> Turn:
        turn = self._begin_turn(session, messages, known_only=False)
        assert turn is not None
        return turn

    def _begin_turn(
        self, session: Session, messages: list[dict[str, Any]] | None, *, known_only: bool
    ) -> Turn | None:
        """The turn `messages` start; with `known_only`, None where its parent would have to
        be read from SQLite (the session is live: `begin_known`)."""
        if not messages:
            return Turn(session, None, 0)
        sid = session.session_id
        live = self._state(sid)
        latest = self.turns.latest(sid)
        cached = _extended(latest, messages)
        if cached is not None:
            # The usual turn: its messages repeat the latest turn's conversation, so only
            # the new ones are hashed (the lineage would hash them all to find the same).
            it = cached.interaction
            n = len(it.messages)
            covered = n + 1
            parent_id: str | None = it.interaction_id
            messages_hash = Lineage.extend(cached.conversation_hash, messages[covered:])
            # The repeated messages are equal to the cached ones: keep one copy of them in
            # memory (a long conversation's text is most of a cached turn's size). The
            # answer only where it was echoed exactly (else the client's form is rendered).
            if messages[n] == it.response:
                messages[:covered] = [*it.messages, cast(dict[str, Any], it.response)]
            else:
                messages[:n] = cast(list[dict[str, Any]], it.messages)
        else:
            parent_id, covered, messages_hash = live.lineage.locate(messages)
            cached = self.turns.get(sid, parent_id) if parent_id is not None else None
            if known_only and cached is None and parent_id is not None:
                return None
        prev = Previous(covered=covered)
        if cached is not None:
            prev.parent, prev.parent_state = cached.interaction, cached.state
        elif parent_id is not None:
            # Rebuilt from SQLite (one query, the bytes of one conversation): the session was
            # evicted from the cache, or recorded before this proxy started.
            prev.parent = self.store.interaction(parent_id)
            prev.reason = "not_cached"
        elif live.next_seq > 0:
            # A new chain in a session that has turns: a conversation's first turn (no
            # earlier answer in it: a sub-agent, a side call such as a title, a new task, a
            # compacted history), or a history whose answers are not the recorded ones (an
            # earlier message edited or dropped, an answer replaced).
            answered = any(m.get("role") == "assistant" for m in messages)
            prev.reason = "history_edited" if answered else "new_conversation"
        prev.latest_state = latest.state if latest is not None else None
        return Turn(session, prev.parent, covered, messages_hash, prev)

    async def record(self, it: Interaction) -> Interaction:
        """Commit a finished interaction; returns it with its id and turn number."""
        return await self.call(self.record_now, it)

    def record_now(
        self,
        it: Interaction,
        *,
        messages_hash: bytes = b"",
        state: PromptState | None = None,
        body_bytes: int = 0,
    ) -> Interaction:
        """Commit `it`; a chat turn's prompt `state` (and its request's `messages_hash` and
        size) is kept for the session's next turn."""
        live = self._state(it.session_id)
        it.seq = live.next_seq
        if not it.interaction_id:
            it.interaction_id = new_id("int")
        after = _hash_prompt(live, it)
        self.store.add_interaction(it)
        # Only once it is committed: a failed insert (disk full) leaves the state as it was.
        live.next_seq += 1
        live.hashed = (it.interaction_id, after)
        if isinstance(it.messages, list) and isinstance(it.response, dict):
            if not messages_hash:
                messages_hash = Lineage.extend(b"", it.messages)
            key = live.lineage.add_after(it.interaction_id, messages_hash, it.response)
            self.turns.put(it.session_id, CachedTurn(it, state, body_bytes, conversation_hash=key))
        return it

    def status(self, session: Session) -> dict[str, Any]:
        """A session's state as its status shows it: turns, and how their prompts were built
        (`prompt`: turns by path, fallbacks by reason; prompt/incremental.py)."""
        paths = self.store.prompt_paths(session.session_id)
        fallbacks = {p.split(":", 1)[1]: n for p, n in paths.items() if p.startswith("full:")}
        cached = self.turns.latest(session.session_id)
        return {
            "session_id": session.session_id,
            "group_id": session.group_id,
            "task_id": session.task_id,
            "model": session.model,
            "created_at": session.created_at,
            "last_active_at": session.last_active_at,
            "ended": session.ended_at is not None,
            "interactions": session.n_interactions,
            "prompt": {
                "incremental": paths.get("incremental", 0),
                "full": paths.get("full", 0) + sum(fallbacks.values()),
                "fallbacks": fallbacks,
                "cached": cached is not None,
                "last_prompt_tokens": len(cached.interaction.prompt_ids) if cached else None,
            },
        }

    # -- rewards and export -------------------------------------------------

    def set_reward(self, session: Session, interaction_id: str, reward: float) -> str:
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or reward != reward:
            raise InvalidRequest("reward must be a finite number", param="reward")
        # A reward closes the session (set_reward_finish_timeout): no more turns, and no
        # reward changes -- but an interaction still without one may get it, named by id, so
        # the choices of one request (`n`, a GRPO group from one call) can each be rewarded.
        closed = self._closed_by_reward(session)
        if closed and not interaction_id:
            raise self._finished(session.session_id)
        iid = interaction_id or self.store.last_interaction_id(session.session_id)
        if iid is None:
            raise Conflict(
                f"session '{session.session_id}' has no interaction to reward yet",
                code="no_interaction",
            )
        if not self.store.set_reward(
            session.session_id, iid, float(reward), time.time(), only_unrewarded=closed
        ):
            if closed and self.store.interaction(iid) is not None:
                raise self._finished(session.session_id)
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
                if self.lost_data:
                    raise ReplicaDataLost(f"group '{group_id}' not found: {self.lost_data}")
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
                raise self.missing(sid)
            out.append(s)
        return out

    def export_rows(
        self,
        sessions: list[Session],
        style: str,
        discount: float,
        side_calls: str = "include",
        *,
        version: int = 0,
        policy: Policy | None = None,
        summary: Summary | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Rows of `sessions`, each with its staleness against `version`, as `policy` keeps
        them (recording/selection.py), counted in `summary` as they are read."""
        policy = policy or Policy()
        policy.check()
        if policy.by_group:
            sessions = selection.by_group(sessions)
        if style not in export.STYLES:
            raise InvalidRequest(f"style must be one of {', '.join(export.STYLES)}", param="style")
        if not 0.0 <= discount <= 1.0:
            raise InvalidRequest("discount must be between 0 and 1", param="discount")
        if side_calls not in export.SIDE_CALLS:
            raise InvalidRequest(
                f"side_calls must be one of {', '.join(export.SIDE_CALLS)}", param="side_calls"
            )
        pairs = zip(
            sessions, self.store.iter_interactions([s.session_id for s in sessions]), strict=True
        )
        return export.rows(
            pairs,
            style,
            discount,
            recorder=self.proxy_id,
            side_calls=side_calls,
            version=version,
            policy=policy,
            summary=summary,
        )

    def remove(self, sessions: list[Session]) -> None:
        self.remove_ids([s.session_id for s in sessions])

    def remove_ids(self, ids: list[str]) -> None:
        for sid in ids:
            self._live.pop(sid, None)
        self.turns.drop(ids)
        self.store.delete_sessions(ids)
        self._count_live()


def _nothing() -> None:
    return None


def _hash_prompt(live: _Live, it: Interaction) -> Any:
    """Set `it.prompt_hash` (spans.prompt_hash of its prompt ids, unless already set); returns
    a hasher fed its prompt + output ids. A turn that continues the latest turn's exact ids
    (`inherited`) hashes only its own: the cost of a turn stays what is new."""
    h = None
    if live.hashed is not None and it.inherited and it.parent_id == live.hashed[0]:
        h = live.hashed[1].copy()
        h.update(pack_ids(it.prompt_ids[it.inherited :]))
    else:
        h = prompt_hasher(it.prompt_ids)
    if not it.prompt_hash:
        it.prompt_hash = h.hexdigest()
    h.update(pack_ids(it.output_ids))
    return h


def _extended(latest: CachedTurn | None, messages: list[dict[str, Any]]) -> CachedTurn | None:
    """`latest` when `messages` are its messages and answer exactly, then more; else None."""
    if latest is None or not latest.conversation_hash:
        return None
    it = latest.interaction
    if not isinstance(it.messages, list) or not isinstance(it.response, dict):
        return None
    n = len(it.messages)
    if len(messages) <= n + 1 or messages[:n] != it.messages:
        return None
    # The answer as echoed: equal, or equal by meaning (the lineage's form: its tool calls'
    # arguments re-serialized, its content null for "").
    if messages[n] != it.response and canonical(messages[n]) != canonical(it.response):
        return None
    return latest
