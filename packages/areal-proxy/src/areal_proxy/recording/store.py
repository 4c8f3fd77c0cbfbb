"""SQLite (WAL) storage of sessions and interactions, one database per proxy.

Every write commits before it returns: an acknowledged interaction or reward
survives a SIGKILL of the proxy (WAL with synchronous=NORMAL is durable
against a process crash; only an OS crash can lose the last commits).
Token arrays are stored packed (int32 ids and versions, float64 logprobs).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from areal_proxy.recording.model import Interaction, Session
from areal_runtime.errors import StorageFull

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
  session_id TEXT PRIMARY KEY,
  group_id TEXT NOT NULL,
  task_id TEXT NOT NULL,
  key_hash TEXT NOT NULL,
  model TEXT NOT NULL,
  created_at REAL NOT NULL,
  last_active_at REAL NOT NULL,
  ended_at REAL,
  last_reward_at REAL,
  n_interactions INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_by_group ON sessions(group_id);
CREATE INDEX IF NOT EXISTS sessions_by_activity ON sessions(ended_at, last_active_at);
CREATE TABLE IF NOT EXISTS interactions (
  interaction_id TEXT PRIMARY KEY,
  session_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  parent_id TEXT,
  messages BLOB NOT NULL,
  response BLOB NOT NULL,
  prompt_ids BLOB NOT NULL,
  output_ids BLOB NOT NULL,
  logprobs BLOB NOT NULL,
  versions BLOB NOT NULL,
  finish_reason TEXT NOT NULL,
  reward REAL,
  created_at REAL NOT NULL,
  finished_at REAL NOT NULL,
  timings BLOB NOT NULL,
  inherited INTEGER NOT NULL DEFAULT 0,
  UNIQUE (session_id, seq)
);
"""

_SESSION_COLS = (
    "session_id, group_id, task_id, key_hash, model, created_at, last_active_at, ended_at, "
    "last_reward_at, n_interactions"
)
_INTERACTION_COLS = (
    "interaction_id, session_id, seq, parent_id, messages, response, prompt_ids, output_ids, "
    "logprobs, versions, finish_reason, reward, created_at, finished_at, timings, inherited"
)


def _ints(values: list[int]) -> bytes:
    return array("i", values).tobytes()


def _floats(values: list[float]) -> bytes:
    return array("d", values).tobytes()


def _unints(blob: bytes) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    return a.tolist()


def _unfloats(blob: bytes) -> list[float]:
    a = array("d")
    a.frombytes(blob)
    return a.tolist()


def _session(row: tuple[Any, ...]) -> Session:
    return Session(*row)


def _interaction(row: tuple[Any, ...]) -> Interaction:
    (iid, sid, seq, parent, msgs, resp, p, o, lp, v, fin, rew, c, f, tim, inh) = row
    return Interaction(
        interaction_id=iid,
        session_id=sid,
        seq=seq,
        messages=orjson.loads(msgs),
        response=orjson.loads(resp),
        prompt_ids=_unints(p),
        output_ids=_unints(o),
        logprobs=_unfloats(lp),
        versions=_unints(v),
        finish_reason=fin,
        parent_id=parent,
        reward=rew,
        created_at=c,
        finished_at=f,
        timings=orjson.loads(tim),
        inherited=inh,
    )


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        if self.path != ":memory:":
            Path(self.path).chmod(0o600)

    def close(self) -> None:
        self._db.close()

    # -- sessions -----------------------------------------------------------

    def add_sessions(self, sessions: Iterable[Session]) -> None:
        rows = [
            (
                s.session_id,
                s.group_id,
                s.task_id,
                s.key_hash,
                s.model,
                s.created_at,
                s.last_active_at,
                s.ended_at,
                s.last_reward_at,
                s.n_interactions,
            )
            for s in sessions
        ]
        with self._tx():
            self._db.executemany(
                f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?)", rows
            )

    def session(self, session_id: str) -> Session | None:
        row = self._db.execute(
            f"SELECT {_SESSION_COLS} FROM sessions WHERE session_id = ?", (session_id,)
        ).fetchone()
        return _session(row) if row else None

    def sessions_of_group(self, group_id: str) -> list[Session]:
        rows = self._db.execute(
            f"SELECT {_SESSION_COLS} FROM sessions WHERE group_id = ? ORDER BY session_id",
            (group_id,),
        ).fetchall()
        return [_session(r) for r in rows]

    def end_sessions(self, session_ids: Iterable[str], at: float | None = None) -> int:
        at = time.time() if at is None else at
        with self._tx():
            cur = self._db.executemany(
                "UPDATE sessions SET ended_at = ? WHERE session_id = ? AND ended_at IS NULL",
                [(at, s) for s in session_ids],
            )
        return cur.rowcount

    def expire_idle(self, idle_before: float, at: float | None = None) -> list[str]:
        """End sessions idle since `idle_before`; returns their ids."""
        ids = [
            r[0]
            for r in self._db.execute(
                "SELECT session_id FROM sessions WHERE ended_at IS NULL AND last_active_at < ?",
                (idle_before,),
            )
        ]
        if ids:
            self.end_sessions(ids, at)
        return ids

    def delete_sessions(self, session_ids: list[str]) -> None:
        with self._tx():
            self._db.executemany(
                "DELETE FROM interactions WHERE session_id = ?", [(s,) for s in session_ids]
            )
            self._db.executemany(
                "DELETE FROM sessions WHERE session_id = ?", [(s,) for s in session_ids]
            )

    def live_session_count(self) -> int:
        return self._db.execute("SELECT count(*) FROM sessions WHERE ended_at IS NULL").fetchone()[
            0
        ]

    # -- interactions -------------------------------------------------------

    def add_interaction(self, it: Interaction) -> None:
        row = (
            it.interaction_id,
            it.session_id,
            it.seq,
            it.parent_id,
            orjson.dumps(it.messages),
            orjson.dumps(it.response),
            _ints(it.prompt_ids),
            _ints(it.output_ids),
            _floats(it.logprobs),
            _ints(it.versions),
            it.finish_reason,
            it.reward,
            it.created_at,
            it.finished_at,
            orjson.dumps(it.timings),
            it.inherited,
        )
        with self._tx():
            self._db.execute(
                f"INSERT INTO interactions ({_INTERACTION_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                row,
            )
            self._db.execute(
                "UPDATE sessions SET n_interactions = n_interactions + 1, last_active_at = ? "
                "WHERE session_id = ?",
                (it.finished_at, it.session_id),
            )

    def interactions(self, session_id: str) -> list[Interaction]:
        rows = self._db.execute(
            f"SELECT {_INTERACTION_COLS} FROM interactions WHERE session_id = ? ORDER BY seq",
            (session_id,),
        ).fetchall()
        return [_interaction(r) for r in rows]

    def interaction(self, interaction_id: str) -> Interaction | None:
        row = self._db.execute(
            f"SELECT {_INTERACTION_COLS} FROM interactions WHERE interaction_id = ?",
            (interaction_id,),
        ).fetchone()
        return _interaction(row) if row else None

    def iter_interactions(self, session_ids: list[str]) -> Iterator[list[Interaction]]:
        """Each session's interactions in order, one session at a time (bounded memory)."""
        for sid in session_ids:
            yield self.interactions(sid)

    def last_interaction_id(self, session_id: str) -> str | None:
        row = self._db.execute(
            "SELECT interaction_id FROM interactions WHERE session_id = ? ORDER BY seq DESC LIMIT 1",
            (session_id,),
        ).fetchone()
        return row[0] if row else None

    def set_reward(self, session_id: str, interaction_id: str, reward: float, at: float) -> bool:
        with self._tx():
            cur = self._db.execute(
                "UPDATE interactions SET reward = ? WHERE interaction_id = ? AND session_id = ?",
                (reward, interaction_id, session_id),
            )
            if cur.rowcount:
                self._db.execute(
                    "UPDATE sessions SET last_reward_at = ?, last_active_at = ? WHERE session_id = ?",
                    (at, at, session_id),
                )
        return cur.rowcount == 1

    def interaction_count(self) -> int:
        return self._db.execute("SELECT count(*) FROM interactions").fetchone()[0]

    # -- helpers ------------------------------------------------------------

    def _tx(self) -> _Transaction:
        return _Transaction(self._db, self.path)


def _out_of_space(exc: BaseException) -> bool:
    """SQLite's "database or disk is full": the filesystem had no room (ENOSPC on a write of
    the database or its WAL; the shared-memory file could not grow), or max_page_count."""
    if not isinstance(exc, sqlite3.Error):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        return "disk is full" in str(exc)
    return code & 0xFF == sqlite3.SQLITE_FULL or code == sqlite3.SQLITE_IOERR_SHMSIZE


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any failure; a full disk is StorageFull (the
    transaction wrote nothing, and the same write succeeds once there is space again)."""

    def __init__(self, db: sqlite3.Connection, path: str) -> None:
        self._db = db
        self._path = path

    def __enter__(self) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise self._translate(e) from e

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                self._db.execute("COMMIT")
                return
            except sqlite3.Error as e:
                exc = e
        # SQLite may have rolled the transaction back itself (it does on SQLITE_FULL), and a
        # ROLLBACK with none open would raise and hide the real error.
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error as e:  # the original error is the one that matters
                log.warning("rollback after %r failed: %r", exc, e)
        translated = self._translate(exc)
        if translated is not exc:
            raise translated from exc
        if exc_type is None:  # COMMIT itself failed
            raise exc

    def _translate(self, exc: BaseException) -> BaseException:
        if _out_of_space(exc):
            return StorageFull(
                f"the proxy's session storage is full ({self._path}: {exc}); nothing was "
                "written: free space and retry"
            )
        return exc
