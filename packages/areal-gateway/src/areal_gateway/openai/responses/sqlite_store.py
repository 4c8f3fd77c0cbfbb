"""`--response-store PATH`: the stored responses in one SQLite file that every gateway
process of a service shares (store.py says what an entry is and why it holds only its own
turn).

- WAL mode: readers never wait for the writer, and a gateway killed mid-write (kill -9)
  leaves the file consistent; the next one to open it recovers the log.
- Several processes write: each write is one `BEGIN IMMEDIATE` transaction (it takes the
  write lock up front, so two writers never deadlock upgrading a read), and a writer that
  finds the lock held waits for it (`BUSY_TIMEOUT_S`) instead of failing.
- Off the event loop: every call runs on this store's one thread, which owns the
  connection. The calls are small (a handful of indexed statements; well under a
  millisecond uncontended), but a write may wait for another process's lock, which must
  not stall the requests this gateway is serving meanwhile.
- Ages are wall-clock seconds (`time.time()`), the one clock the processes share.
- The file is created 0600 (it holds conversations); SQLite creates its `-wal` and `-shm`
  files with the same mode. Its folder must exist (settings.validate checks).
- Count and bytes are kept in a one-row table by triggers, so a bound check reads one row
  whichever process wrote last.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson

from areal_gateway.openai.responses.store import MAX_BYTES, MAX_ENTRIES, TTL_S, Entry, Items

BUSY_TIMEOUT_S = 10.0
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    parent TEXT,
    used REAL NOT NULL,
    size INTEGER NOT NULL,
    inputs BLOB NOT NULL,
    outputs BLOB NOT NULL,
    response BLOB NOT NULL
);
-- Eviction order: least recently used first; of one chain used together, its newest turn.
CREATE INDEX IF NOT EXISTS responses_lru ON responses (used, seq DESC);
CREATE TABLE IF NOT EXISTS totals (one INTEGER PRIMARY KEY CHECK (one = 1), n INTEGER, bytes INTEGER);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses BEGIN
    UPDATE totals SET n = n + 1, bytes = bytes + NEW.size;
END;
CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses BEGIN
    UPDATE totals SET n = n - 1, bytes = bytes - OLD.size;
END;
"""

# A response and its ancestors, newest first (depth 0 is the response itself).
_CHAIN = """
WITH RECURSIVE chain(id, parent, owner, used, inputs, outputs, depth) AS (
    SELECT id, parent, owner, used, inputs, outputs, 0 FROM responses WHERE id = ?
    UNION ALL
    SELECT r.id, r.parent, r.owner, r.used, r.inputs, r.outputs, c.depth + 1
    FROM responses r JOIN chain c ON r.id = c.parent
    WHERE c.depth < ?
)
SELECT id, parent, owner, used, inputs, outputs FROM chain ORDER BY depth
"""
_CHAIN_IDS = """
WITH RECURSIVE chain(id, parent, depth) AS (
    SELECT id, parent, 0 FROM responses WHERE id = ?
    UNION ALL
    SELECT r.id, r.parent, c.depth + 1 FROM responses r JOIN chain c ON r.id = c.parent
    WHERE c.depth < ?
)
SELECT id FROM chain
"""


def open_file(path: str) -> sqlite3.Connection:
    """The connection to the store at `path`, made and set up (raises OSError or
    sqlite3.Error with what is wrong)."""
    # Created 0600 before SQLite sees it (SQLite would use the umask's mode).
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    conn = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        # WAL: a commit is durable at the next checkpoint, never torn; a power cut may lose
        # the last turns, which a client then sees as previous_response_not_found.
        conn.execute("PRAGMA synchronous=NORMAL")
        # One script, one transaction: gateways starting together create the schema once.
        conn.executescript(f"BEGIN IMMEDIATE;{_SCHEMA}COMMIT;")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Any:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class SqliteStore:
    """The shared store (see the module docstring); the interface of store.ResponseStore."""

    def __init__(
        self,
        path: str,
        max_entries: int = MAX_ENTRIES,
        ttl_s: float = TTL_S,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.path = path
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="response-store")
        self._conn: sqlite3.Connection | None = self._pool.submit(open_file, path).result()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.ProgrammingError("the response store is closed")
        return self._conn

    # -- the interface (async) --
    async def put(self, entry: Entry) -> None:
        await self._run(self.put_now, entry)

    async def conversation(self, response_id: str, owner: str) -> Items | None:
        return await self._run(self.conversation_now, response_id, owner)

    async def response(self, response_id: str, owner: str) -> bytes | None:
        return await self._run(self.response_now, response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self._run(self.delete_now, response_id, owner)

    async def aclose(self) -> None:
        if self._conn is None:
            return
        await self._run(self._close)
        self._pool.shutdown(wait=False)

    # -- the same, blocking (on the store's thread) --
    def put_now(self, entry: Entry) -> None:
        db = self._db()
        now = time.time()
        with _transaction(db):
            db.execute("DELETE FROM responses WHERE id = ?", (entry.response_id,))
            db.execute("DELETE FROM responses WHERE used < ?", (now - self.ttl_s,))
            if entry.size > self.max_bytes:
                return
            db.execute(
                "INSERT INTO responses (id, owner, parent, used, size, inputs, outputs, response)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    entry.response_id,
                    entry.owner,
                    entry.parent,
                    now,
                    entry.size,
                    orjson.dumps(entry.inputs),
                    orjson.dumps(entry.outputs),
                    entry.response,
                ),
            )
            # The chain was used now; its newest turn (highest seq) is evicted first.
            ids = [r[0] for r in db.execute(_CHAIN_IDS, (entry.response_id, self.max_entries))]
            self._touch(db, ids, now)
            self._evict(db)

    def conversation_now(self, response_id: str, owner: str) -> Items | None:
        db = self._db()
        now = time.time()
        rows = db.execute(_CHAIN, (response_id, self.max_entries)).fetchall()
        cutoff = now - self.ttl_s
        if (
            not rows
            or rows[-1][1] is not None  # a turn of the chain is gone
            or any(r[2] != owner or r[3] < cutoff for r in rows)
        ):
            return None
        with _transaction(db):
            self._touch(db, [r[0] for r in rows], now)
        items: Items = []
        for row in reversed(rows):
            items += orjson.loads(row[4])
            items += orjson.loads(row[5])
        return items

    def response_now(self, response_id: str, owner: str) -> bytes | None:
        row = (
            self._db()
            .execute(
                "SELECT response FROM responses WHERE id = ? AND owner = ? AND used >= ?",
                (response_id, owner, time.time() - self.ttl_s),
            )
            .fetchone()
        )
        return bytes(row[0]) if row is not None else None

    def delete_now(self, response_id: str, owner: str) -> bool:
        db = self._db()
        with _transaction(db):
            cur = db.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ? AND used >= ?",
                (response_id, owner, time.time() - self.ttl_s),
            )
        return cur.rowcount > 0

    def totals(self) -> tuple[int, int]:
        """(entries, bytes) in the file."""
        n, size = self._db().execute("SELECT n, bytes FROM totals").fetchone()
        return int(n), int(size)

    # -- helpers (inside a transaction) --
    @staticmethod
    def _touch(db: sqlite3.Connection, ids: list[str], now: float) -> None:
        db.executemany("UPDATE responses SET used = ? WHERE id = ?", [(now, i) for i in ids])

    def _evict(self, db: sqlite3.Connection) -> None:
        n, size = db.execute("SELECT n, bytes FROM totals").fetchone()
        if n <= self.max_entries and size <= self.max_bytes:
            return
        doomed = []
        for seq, sz in db.execute("SELECT seq, size FROM responses ORDER BY used, seq DESC"):
            if n <= self.max_entries and size <= self.max_bytes:
                break
            doomed.append((seq,))
            n -= 1
            size -= sz
        db.executemany("DELETE FROM responses WHERE seq = ?", doomed)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
