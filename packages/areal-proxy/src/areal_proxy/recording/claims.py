"""Export claims: removal of exported sessions only once the client has the rows.

An export with `remove_session` deletes nothing. Deleting as soon as the rows were handed to
gRPC lost them whenever something after that point failed: another proxy of the same export,
the gateway, or the HTTP client going away mid-stream. Instead the export claims each session
it read under its export id, with what the session held when it was read (its number of
interactions and its last reward time); `ack` (AckExport), which the client sends once it has
the whole export, deletes the sessions still claimed by that export and unchanged since. So:

- until the ack, every row stays exportable (a failed or abandoned export loses nothing, and
  needs no timeout to be exportable again: it always is);
- a later export claims the session anew, so the ack of an older export removes nothing that
  the newer one may not have delivered yet;
- a session that gained a turn or a reward after it was read is kept on ack: the client has
  not got that turn (or that reward), and deleting part of a session would break the turns
  stored as a suffix of their parent (store.py).

Claims live in their own table beside the store's, on the store's connection: every method
runs on the recording thread (sessions.py), like every other statement.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field

from areal_proxy.common.records import Session
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.recording.store import storage_error
from areal_runtime.session_keys import key_matches

_SCHEMA = """
CREATE TABLE IF NOT EXISTS export_claims (
  session_id TEXT PRIMARY KEY,
  export_id TEXT NOT NULL,
  n_interactions INTEGER NOT NULL,
  last_reward_at REAL,
  claimed_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS export_claims_by_export ON export_claims(export_id);
"""


@dataclass(slots=True)
class AckResult:
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    emptied_groups: list[str] = field(default_factory=list)


class ExportClaims:
    def __init__(self, book: SessionBook) -> None:
        self.book = book
        self._ready = False

    def _db(self) -> sqlite3.Connection:
        # The store's own connection: one thread, one connection, statements in order.
        db = self.book.store._db
        if not self._ready:
            # Creating the table writes pages: on a full disk, the storage error every other
            # write answers (507), not a 500.
            try:
                db.executescript(_SCHEMA)
            except sqlite3.Error as e:
                translated = storage_error(e, self.book.store.path)
                if translated is e:
                    raise
                raise translated from e
            self._ready = True
        return db

    def claim(self, export_id: str, sessions: list[Session]) -> None:
        """`sessions`, as read by the export `export_id` (their rows all handed over), are
        removed by its ack if they are still so then. A newer claim replaces an older one."""
        db = self._db()
        now = time.time()
        with self.book.store._tx():
            db.executemany(
                "INSERT INTO export_claims "
                "(session_id, export_id, n_interactions, last_reward_at, claimed_at) "
                "VALUES (?,?,?,?,?) ON CONFLICT(session_id) DO UPDATE SET "
                "export_id = excluded.export_id, n_interactions = excluded.n_interactions, "
                "last_reward_at = excluded.last_reward_at, claimed_at = excluded.claimed_at",
                [
                    (s.session_id, export_id, s.n_interactions, s.last_reward_at, now)
                    for s in sessions
                ],
            )

    def ack(self, export_id: str, *, session_id: str = "", api_key: str = "") -> AckResult:
        """Delete what `export_id` claimed and is unchanged since. With `session_id` (a
        session key's ack) only that session, and only if `api_key` is its key."""
        db = self._db()
        rows = db.execute(
            "SELECT session_id, n_interactions, last_reward_at FROM export_claims "
            "WHERE export_id = ?",
            (export_id,),
        ).fetchall()
        out = AckResult()
        remove: list[Session] = []
        dropped: list[str] = []
        for sid, n, reward_at in rows:
            if session_id and sid != session_id:
                continue
            s = self.book.store.session(sid)
            dropped.append(sid)
            if s is None:
                continue  # removed since (another ack, retention): nothing left to do
            if session_id and not key_matches(api_key, s.key_hash):
                dropped.pop()  # not this key's session: its claim stays
                continue
            if s.n_interactions == n and s.last_reward_at == reward_at:
                remove.append(s)
            else:
                out.kept.append(sid)
        if remove:
            self.book.remove(remove)
            out.removed = [s.session_id for s in remove]
            for gid in sorted({s.group_id for s in remove}):
                if not self.book.store.sessions_of_group(gid):
                    out.emptied_groups.append(gid)
        if dropped:
            # After the sessions' removal: a crash in between leaves a claim on a session
            # that is gone, which the next ack of it skips.
            with self.book.store._tx():
                db.executemany(
                    "DELETE FROM export_claims WHERE session_id = ? AND export_id = ?",
                    [(sid, export_id) for sid in dropped],
                )
        return out
