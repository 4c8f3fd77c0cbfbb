"""SQLite (WAL) storage of sessions and interactions, one database per proxy.

Every write commits before it returns: an acknowledged interaction or reward
survives a SIGKILL of the proxy (WAL with synchronous=NORMAL is durable
against a process crash; only an OS crash can lose the last commits).
Token arrays are stored packed (int32 ids and versions, float64 logprobs).

A turn stores what is new, so disk per turn stays flat however long the conversation: its
messages beyond its parent's conversation (`shared_messages` leading ones are the parent's
messages + answer) and its prompt ids beyond those it shares with the parent's prompt +
output (`shared_tokens`). Reading rebuilds the whole interaction from the chain of parents,
exactly as it was recorded (the messages a client echoed back are the parent's, which the
lineage matched them to; only role, text and tool calls count there). A database written
before these columns existed is migrated in place: its rows share nothing and read as before.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from areal_proxy.common.records import Interaction, Session
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
  shared_tokens INTEGER NOT NULL DEFAULT 0,
  shared_messages INTEGER NOT NULL DEFAULT 0,
  response_id TEXT NOT NULL DEFAULT '',
  choice_index INTEGER NOT NULL DEFAULT 0,
  prompt_path TEXT NOT NULL DEFAULT '',
  replicas BLOB NOT NULL DEFAULT x'',
  call_kind TEXT NOT NULL DEFAULT '',
  tools_declared INTEGER NOT NULL DEFAULT 0,
  tool_calls_made INTEGER NOT NULL DEFAULT 0,
  tool_calls_parsed INTEGER NOT NULL DEFAULT 0,
  prompt_hash TEXT NOT NULL DEFAULT '',
  UNIQUE (session_id, seq)
);
"""
# Columns added after the first schema: (table, column, definition), added when missing.
_MIGRATIONS = (
    ("interactions", "shared_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("interactions", "shared_messages", "INTEGER NOT NULL DEFAULT 0"),
    ("sessions", "exported_at", "REAL"),
    ("interactions", "response_id", "TEXT NOT NULL DEFAULT ''"),
    ("interactions", "choice_index", "INTEGER NOT NULL DEFAULT 0"),
    ("interactions", "prompt_path", "TEXT NOT NULL DEFAULT ''"),
    # Which proxy made which output tokens (JSON [[index, proxy id], ...]); empty: all by the
    # recording proxy, as every row from before migration reads.
    ("interactions", "replicas", "BLOB NOT NULL DEFAULT x''"),
    # Chains and side calls, tool-call parsing, certified spans (recording/chains.py): rows
    # from before read as unmarked, with no tool counts and no prompt hash (not certified).
    ("interactions", "call_kind", "TEXT NOT NULL DEFAULT ''"),
    ("interactions", "tools_declared", "INTEGER NOT NULL DEFAULT 0"),
    ("interactions", "tool_calls_made", "INTEGER NOT NULL DEFAULT 0"),
    ("interactions", "tool_calls_parsed", "INTEGER NOT NULL DEFAULT 0"),
    ("interactions", "prompt_hash", "TEXT NOT NULL DEFAULT ''"),
    # Why a session failed, as its end said ("" for none, and for rows from before).
    ("sessions", "failure", "TEXT NOT NULL DEFAULT ''"),
)
# After the migrations: the index on a migrated column.
_INDEXES = """
CREATE INDEX IF NOT EXISTS sessions_by_export ON sessions(exported_at)
  WHERE exported_at IS NOT NULL;
"""

_SESSION_COLS = (
    "session_id, group_id, task_id, key_hash, model, created_at, last_active_at, ended_at, "
    "last_reward_at, n_interactions, failure"
)
_INTERACTION_COLS = (
    "interaction_id, session_id, seq, parent_id, messages, response, prompt_ids, output_ids, "
    "logprobs, versions, finish_reason, reward, created_at, finished_at, timings, inherited, "
    "shared_tokens, shared_messages, response_id, choice_index, prompt_path, replicas, call_kind, "
    "tools_declared, tool_calls_made, tool_calls_parsed, prompt_hash"
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
    """The row as stored: `prompt_ids` and `messages` hold only what follows the shared
    part (see `_whole`)."""
    (
        iid,
        sid,
        seq,
        parent,
        msgs,
        resp,
        p,
        o,
        lp,
        v,
        fin,
        rew,
        c,
        f,
        tim,
        inh,
        st,
        sm,
        rsp,
        ci,
        pp,
        reps,
        kind,
        declared,
        made,
        parsed,
        phash,
    ) = row
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
        shared_tokens=st,
        shared_messages=sm,
        response_id=rsp,
        choice_index=ci,
        prompt_path=pp,
        replicas=[(i, r) for i, r in orjson.loads(reps)] if reps else [],
        call_kind=kind,
        tools_declared=declared,
        tool_calls_made=made,
        tool_calls_parsed=parsed,
        prompt_hash=phash,
    )


def _tokens(it: Interaction) -> list[Any]:
    return it.prompt_ids + it.output_ids


def _conversation(it: Interaction) -> list[Any]:
    msgs = it.messages if isinstance(it.messages, list) else []
    return [*msgs, it.response]


def _whole(chain: list[Interaction]) -> Interaction:
    """The last of `chain` (stored rows, root first, each the parent of the next) rebuilt
    whole. The shared prefix is gathered backwards as slices of each ancestor's own part, so
    the cost is the length of the result, not the sum of every ancestor's length."""
    it = chain[-1]
    it.prompt_ids = _gather(chain, it.shared_tokens, lambda r: r.shared_tokens, _tokens) + (
        it.prompt_ids
    )
    if it.shared_messages and isinstance(it.messages, list):
        it.messages = (
            _gather(chain, it.shared_messages, lambda r: r.shared_messages, _conversation)
            + it.messages
        )
    return it


def _gather(
    chain: list[Interaction],
    m: int,
    shared: Callable[[Interaction], int],
    own: Callable[[Interaction], list[Any]],
) -> list[Any]:
    """The first `m` items of the whole sequence of chain[-2] (a row's whole sequence is its
    parent's first `shared` items, then its own part)."""
    pieces: list[list[Any]] = []
    for row in reversed(chain[:-1]):
        if m <= 0:
            break
        s = shared(row) if row.parent_id is not None else 0
        if m > s:
            pieces.append(own(row)[: m - s])
            m = s
    if m > 0:
        raise ValueError(f"interaction chain of {chain[-1].interaction_id} is incomplete")
    out: list[Any] = []
    for piece in reversed(pieces):
        out.extend(piece)
    return out


def _rebuild_all(rows: list[Interaction]) -> list[Interaction]:
    """A session's stored rows (in seq order: a parent is always recorded before its child)
    rebuilt whole, each from its parent's rebuilt sequence."""
    needed = {r.parent_id for r in rows if r.shared_tokens or r.shared_messages}
    tokens: dict[str, list[int]] = {}
    convs: dict[str, list[Any]] = {}
    for it in rows:
        if it.shared_tokens or it.shared_messages:
            parent = it.parent_id or ""
            if parent not in tokens:
                raise ValueError(f"parent {parent} of {it.interaction_id} is missing")
            it.prompt_ids = tokens[parent][: it.shared_tokens] + it.prompt_ids
            if it.shared_messages and isinstance(it.messages, list):
                it.messages = convs[parent][: it.shared_messages] + it.messages
        if it.interaction_id in needed:
            tokens[it.interaction_id] = _tokens(it)
            convs[it.interaction_id] = _conversation(it)
    return rows


def _shared_prefix(a: list[Any], b: list[Any]) -> int:
    """len of the common prefix of `a` and `b` (slices compare in C: O(n log n) there,
    rather than a Python loop over every item)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _tokens_from(parent: Interaction, start: int) -> list[int]:
    """parent's prompt + output ids from `start` on, without copying the part before it."""
    pp = parent.prompt_ids
    if start <= len(pp):
        return pp[start:] + parent.output_ids
    return parent.output_ids[start - len(pp) :]


def continues(prompt: list[int], parent: Interaction, known: int = 0) -> bool:
    """Whether `prompt` starts with `parent`'s prompt + output ids, of which the first
    `known` are known to match (a turn's cost then grows with what is new only)."""
    n = len(parent.prompt_ids) + len(parent.output_ids)
    if len(prompt) < n:
        return False
    known = min(known, n)
    return prompt[known:n] == _tokens_from(parent, known)


def sharing(
    it: Interaction, parent: Interaction | None, covered: int, known: int = 0
) -> tuple[int, int]:
    """(shared_tokens, shared_messages) of a new turn `it` on `parent` (whole), whose
    conversation covers the first `covered` of its messages; the first `known` prompt ids
    are known to be the parent's."""
    if parent is None:
        return 0, 0
    known = min(known, len(it.prompt_ids), len(parent.prompt_ids) + len(parent.output_ids))
    tokens = known + _shared_prefix(it.prompt_ids[known:], _tokens_from(parent, known))
    msgs = covered if isinstance(it.messages, list) and isinstance(parent.response, dict) else 0
    n_conv = (len(parent.messages) if isinstance(parent.messages, list) else 0) + 1
    return tokens, min(msgs, n_conv)


# WAL pages between checkpoints when the owner runs them (`manual_checkpoints`): SQLite's
# own default.
_CHECKPOINT_PAGES = 1000
# Sessions `remember` keeps at most (all are forgotten at once past it: a cache of facts
# that each first turn after reads again).
_KNOWN_MAX = 100_000


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
        for table, column, definition in _MIGRATIONS:
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        self._db.executescript(_INDEXES)
        if self.path != ":memory:":
            Path(self.path).chmod(0o600)
        # Sessions as a read left them (`remember`), for the key check of a session's next
        # turn without a query (`known_session`). Every write to a session's row here drops
        # its entry or updates it as the row changed.
        self._known: dict[str, Session] = {}
        # WAL pages written since the last checkpoint, estimated (`manual_checkpoints`).
        self._wal_pages = 0
        self._manual_checkpoints = False

    def manual_checkpoints(self) -> None:
        """No checkpoint at commit: the owner runs `checkpoint` when `checkpoint_due` (off the
        event loop: a checkpoint copies pages and syncs files, and a commit on the loop must
        not start one). SQLite's own default is a checkpoint at a commit past 1000 pages."""
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._manual_checkpoints = True

    @property
    def checkpoint_due(self) -> bool:
        return self._manual_checkpoints and self._wal_pages >= _CHECKPOINT_PAGES

    def checkpoint(self) -> None:
        self._wal_pages = 0
        self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def remember(self, s: Session) -> None:
        """Keep `s`, just read from its row, for `known_session`."""
        if len(self._known) >= _KNOWN_MAX:
            self._known.clear()
        self._known[s.session_id] = s

    def known_session(self, session_id: str) -> Session | None:
        """The session as `remember` kept it and the writes since left it, or None (not
        kept: read it with `session`). No query."""
        return self._known.get(session_id)

    def _forget(self, session_ids: Iterable[str]) -> None:
        known = self._known
        for sid in session_ids:
            known.pop(sid, None)

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
                s.failure,
            )
            for s in sessions
        ]
        self._forget(r[0] for r in rows)
        with self._tx():
            self._db.executemany(
                f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows
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
        session_ids = list(session_ids)
        self._forget(session_ids)
        with self._tx():
            cur = self._db.executemany(
                "UPDATE sessions SET ended_at = ? WHERE session_id = ? AND ended_at IS NULL",
                [(at, s) for s in session_ids],
            )
        return cur.rowcount

    def fail_sessions(self, session_ids: Iterable[str], failure: str) -> int:
        """Record why sessions failed, on those with no failure yet (ended or not)."""
        session_ids = list(session_ids)
        self._forget(session_ids)
        with self._tx():
            cur = self._db.executemany(
                "UPDATE sessions SET failure = ? WHERE session_id = ? AND failure = ''",
                [(failure, s) for s in session_ids],
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

    def mark_exported(self, session_ids: Iterable[str], at: float | None = None) -> None:
        at = time.time() if at is None else at
        with self._tx():
            self._db.executemany(
                "UPDATE sessions SET exported_at = ? WHERE session_id = ?",
                [(at, s) for s in session_ids],
            )

    def purgeable(self, before: float) -> list[str]:
        """Sessions ended and exported, both before `before` (retention is over)."""
        return [
            r[0]
            for r in self._db.execute(
                "SELECT session_id FROM sessions WHERE exported_at IS NOT NULL "
                "AND exported_at < ? AND ended_at IS NOT NULL AND ended_at < ?",
                (before, before),
            )
        ]

    def delete_sessions(self, session_ids: list[str]) -> None:
        self._forget(session_ids)
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
        """Store `it` (whole), keeping only what follows its shared prefixes."""
        msgs = it.messages[it.shared_messages :] if isinstance(it.messages, list) else it.messages
        row = (
            it.interaction_id,
            it.session_id,
            it.seq,
            it.parent_id,
            orjson.dumps(msgs),
            orjson.dumps(it.response),
            _ints(it.prompt_ids[it.shared_tokens :]),
            _ints(it.output_ids),
            _floats(it.logprobs),
            _ints(it.versions),
            it.finish_reason,
            it.reward,
            it.created_at,
            it.finished_at,
            orjson.dumps(it.timings),
            it.inherited,
            it.shared_tokens,
            it.shared_messages,
            it.response_id,
            it.choice_index,
            it.prompt_path,
            # The interaction's own output's runs: never shared with the parent (a prompt's
            # shared tokens were generated by a turn that names its own replicas).
            orjson.dumps(it.replicas) if it.replicas else b"",
            it.call_kind,
            it.tools_declared,
            it.tool_calls_made,
            it.tool_calls_parsed,
            it.prompt_hash,
        )
        marks = ",".join("?" * len(row))
        nbytes = sum(len(v) for v in row if isinstance(v, bytes))
        with self._tx(nbytes):
            self._db.execute(
                f"INSERT INTO interactions ({_INTERACTION_COLS}) VALUES ({marks})", row
            )
            self._db.execute(
                "UPDATE sessions SET n_interactions = n_interactions + 1, last_active_at = ? "
                "WHERE session_id = ?",
                (it.finished_at, it.session_id),
            )
        if (s := self._known.get(it.session_id)) is not None:
            s.n_interactions += 1
            s.last_active_at = it.finished_at

    def interactions(self, session_id: str) -> list[Interaction]:
        rows = self._db.execute(
            f"SELECT {_INTERACTION_COLS} FROM interactions WHERE session_id = ? ORDER BY seq",
            (session_id,),
        ).fetchall()
        return _rebuild_all([_interaction(r) for r in rows])

    def conversations(
        self, session_id: str
    ) -> list[tuple[str, int, list[dict[str, Any]] | str, dict[str, Any] | str]]:
        """(interaction id, seq, messages, response) of a session's turns, whole, in order:
        what reloading a session's lineage needs, without unpacking any token array."""
        out = []
        convs: dict[str, list[Any]] = {}
        for iid, seq, parent, msgs, resp, shared in self._db.execute(
            "SELECT interaction_id, seq, parent_id, messages, response, shared_messages "
            "FROM interactions WHERE session_id = ? ORDER BY seq",
            (session_id,),
        ):
            messages, response = orjson.loads(msgs), orjson.loads(resp)
            if shared and isinstance(messages, list):
                if parent not in convs:
                    raise ValueError(f"parent {parent} of {iid} is missing")
                messages = convs[parent][:shared] + messages
            if isinstance(messages, list):
                convs[iid] = [*messages, response]
            out.append((iid, seq, messages, response))
        return out

    def interaction(self, interaction_id: str) -> Interaction | None:
        # The row and the ancestors it shares a prefix with, root first: one query, and the
        # bytes read are those of the one conversation (as a whole row's were).
        rows = self._db.execute(
            f"""WITH RECURSIVE chain(id) AS (
                  SELECT ?
                  UNION ALL
                  SELECT i.parent_id FROM interactions i JOIN chain ON i.interaction_id = chain.id
                  WHERE i.parent_id IS NOT NULL AND (i.shared_tokens > 0 OR i.shared_messages > 0)
                )
                SELECT {_INTERACTION_COLS} FROM interactions
                WHERE interaction_id IN (SELECT id FROM chain) ORDER BY seq""",
            (interaction_id,),
        ).fetchall()
        if not rows:
            return None
        return _whole([_interaction(r) for r in rows])

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

    def set_reward(
        self,
        session_id: str,
        interaction_id: str,
        reward: float,
        at: float,
        *,
        only_unrewarded: bool = False,
    ) -> bool:
        unrewarded = " AND reward IS NULL" if only_unrewarded else ""
        self._forget((session_id,))
        with self._tx():
            cur = self._db.execute(
                "UPDATE interactions SET reward = ? WHERE interaction_id = ? AND session_id = ?"
                + unrewarded,
                (reward, interaction_id, session_id),
            )
            if cur.rowcount:
                self._db.execute(
                    "UPDATE sessions SET last_reward_at = ?, last_active_at = ? WHERE session_id = ?",
                    (at, at, session_id),
                )
        return cur.rowcount == 1

    def prompt_paths(self, session_id: str) -> dict[str, int]:
        """How a session's chat prompts were built: turns by `prompt_path`."""
        return dict(
            self._db.execute(
                "SELECT prompt_path, count(*) FROM interactions WHERE session_id = ? "
                "AND prompt_path != '' GROUP BY prompt_path",
                (session_id,),
            ).fetchall()
        )

    def interaction_count(self) -> int:
        return self._db.execute("SELECT count(*) FROM interactions").fetchone()[0]

    # -- helpers ------------------------------------------------------------

    def _tx(self, nbytes: int = 0) -> _Transaction:
        # A transaction writes a few pages (the row's, the indexes', the session's) and its
        # bytes: an estimate is enough to checkpoint about as often as SQLite would.
        self._wal_pages += 4 + (nbytes >> 12)
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
        return storage_error(exc, self._path)


def storage_error(exc: BaseException, path: str) -> BaseException:
    """What a caller gets for `exc` raised writing the database at `path`: StorageFull for a
    full disk, `exc` itself otherwise."""
    if _out_of_space(exc):
        # The path is for the operator's log only: the error goes to every caller,
        # session-key holders included.
        log.error("session storage full at %s: %s", path, exc)
        return StorageFull(
            "the proxy's session storage is full; nothing was written: free space on "
            "the proxy's data volume and retry"
        )
    return exc
