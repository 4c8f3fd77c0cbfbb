"""`StateStore`: the router's durable state (`--state-file`) in SQLite, one small
transaction per batch of changes.

Why SQLite in WAL mode rather than the JSON file routers wrote before: that file was
rewritten whole (every model, proxy and pin, serialized on the event loop, then fsynced)
after each change, so over a long RL run each pin cost more than the last. Here a change
writes only the rows it touched (`Registry.dirty_*`), on a thread of its own, so its cost
does not depend on how many sessions are pinned.

Durability (the acknowledgement comes after the disk): `synchronous=FULL`, so each commit
fsyncs the write-ahead log before it returns, and `flush()` returns only once the commit
holding every change made before the call has returned. NORMAL would survive a killed
router (the log is in the page cache) but not a power cut; the old writer fsynced, and
FULL keeps that promise at the same price, one fsync per commit. Group commit keeps that
price down: changes made while a commit is running all go into the next one, which
acknowledges all of them together (a burst of binds costs a few fsyncs, not one each).

The file, its `-wal` and its `-shm` are 0600 (SQLite gives the side files the mode of the
database file, which is created 0600 before SQLite opens it); missing folders are made 0700.
A state file written by an older router (JSON) is migrated once at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_router.registry import Registry

log = logging.getLogger("areal_router.store")

SQLITE_MAGIC = b"SQLite format 3\x00"
# Format 1 was the JSON file; this is the SQLite schema below.
SCHEMA_FORMAT = 2
SIDE_FILES = ("-wal", "-shm", "-journal")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS proxies (
    proxy_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pins (
    session_id TEXT PRIMARY KEY,
    proxy_id TEXT NOT NULL,
    used_at REAL NOT NULL,
    bound_by TEXT NOT NULL DEFAULT ''
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS admission (model TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS admitted (
    session_id TEXT PRIMARY KEY, model TEXT NOT NULL, ended INTEGER NOT NULL
) WITHOUT ROWID;
"""


@dataclass
class Batch:
    """Rows to write in one transaction, by key; None deletes the row. A later change of
    the same key replaces an earlier one, so a batch is the net effect of its changes."""

    models: dict[str, str | None] = field(default_factory=dict)
    proxies: dict[str, tuple[int, str] | None] = field(default_factory=dict)
    pins: dict[str, tuple[str, float, str] | None] = field(default_factory=dict)
    # Admission control (areal_router.admission): per model, and per admitted session.
    admission: dict[str, str | None] = field(default_factory=dict)
    admitted: dict[str, tuple[str, int] | None] = field(default_factory=dict)

    def __len__(self) -> int:
        return (
            len(self.models)
            + len(self.proxies)
            + len(self.pins)
            + len(self.admission)
            + len(self.admitted)
        )


def _private_dir(path: Path) -> None:
    """Create `path` and its missing parents 0700 (an existing folder is left as it is:
    it may be the operator's own; the files in it are 0600 whatever it is)."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)
            os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask


def _create_private(path: Path) -> None:
    """Make sure `path` exists with mode 0600 before SQLite opens it: SQLite creates the
    -wal and -shm files with the database file's mode."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _connect(path: Path, *, wal: bool) -> sqlite3.Connection:
    # isolation_level=None: transactions are the explicit BEGIN/COMMIT below.
    # check_same_thread=False: opened here, then used by the store's one writer thread
    # (never by two threads at once).
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    mode = db.execute(f"PRAGMA journal_mode={'WAL' if wal else 'DELETE'}").fetchone()[0]
    if wal and str(mode).lower() != "wal":
        db.close()
        raise ValueError(f"state file {path}: SQLite refused WAL mode ({mode})")
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(_SCHEMA)
    return db


def _apply(db: sqlite3.Connection, batch: Batch) -> None:
    """Write one batch in one transaction (blocking: runs on the writer thread)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        upserts = [(k, v) for k, v in batch.models.items() if v is not None]
        deletes = [(k,) for k, v in batch.models.items() if v is None]
        if upserts:
            db.executemany("INSERT OR REPLACE INTO models (name, doc) VALUES (?, ?)", upserts)
        if deletes:
            db.executemany("DELETE FROM models WHERE name = ?", deletes)
        proxies = [(k, *v) for k, v in batch.proxies.items() if v is not None]
        deletes = [(k,) for k, v in batch.proxies.items() if v is None]
        if proxies:
            db.executemany(
                "INSERT OR REPLACE INTO proxies (proxy_id, seq, doc) VALUES (?, ?, ?)", proxies
            )
        if deletes:
            db.executemany("DELETE FROM proxies WHERE proxy_id = ?", deletes)
        pins = [(k, *v) for k, v in batch.pins.items() if v is not None]
        deletes = [(k,) for k, v in batch.pins.items() if v is None]
        if pins:
            db.executemany(
                "INSERT OR REPLACE INTO pins (session_id, proxy_id, used_at, bound_by)"
                " VALUES (?, ?, ?, ?)",
                pins,
            )
        if deletes:
            db.executemany("DELETE FROM pins WHERE session_id = ?", deletes)
        docs = [(k, v) for k, v in batch.admission.items() if v is not None]
        deletes = [(k,) for k, v in batch.admission.items() if v is None]
        if docs:
            db.executemany("INSERT OR REPLACE INTO admission (model, doc) VALUES (?, ?)", docs)
        if deletes:
            db.executemany("DELETE FROM admission WHERE model = ?", deletes)
        rows = [(k, *v) for k, v in batch.admitted.items() if v is not None]
        deletes = [(k,) for k, v in batch.admitted.items() if v is None]
        if rows:
            db.executemany(
                "INSERT OR REPLACE INTO admitted (session_id, model, ended) VALUES (?, ?, ?)",
                rows,
            )
        if deletes:
            db.executemany("DELETE FROM admitted WHERE session_id = ?", deletes)
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


class StateStore:
    """The registry's durable part in SQLite at `path`. `flush()` after each change,
    before the change is acknowledged: it returns once every change made before it is
    committed (fsynced). Commits run one at a time on a thread of their own; changes made
    meanwhile share the next commit."""

    def __init__(self, path: str | Path, registry: Registry) -> None:
        self.path = Path(path)
        self.registry = registry
        self._db: sqlite3.Connection | None = None
        # One thread: SQLite work never runs on the event loop, and never two at once.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-state")
        # Collected, not yet committed; and the future its commit will resolve.
        self._next: Batch | None = None
        self._next_done: asyncio.Future[None] | None = None
        # The commit now running (None when idle).
        self._running: asyncio.Future[None] | None = None
        self._committer: asyncio.Task[None] | None = None
        self._closed = False
        # Counters (the benchmark reads them; each commit is one fsync of the log).
        self.commits = 0
        self.rows_written = 0

    # -- start ------------------------------------------------------------

    def load(self) -> bool:
        """Open (or create) the store and load it into the registry. False if there was no
        state yet. A file that exists but is neither an SQLite store nor a JSON state of an
        older router raises: starting empty would overwrite every registration."""
        exists = self.path.exists()
        _private_dir(self.path.parent)
        if exists:
            with open(self.path, "rb") as f:
                head = f.read(len(SQLITE_MAGIC))
            if head and head != SQLITE_MAGIC:
                self._migrate_json()
        _create_private(self.path)
        try:
            self._db = _connect(self.path, wal=True)
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(f"{self.path}{suffix}", 0o600)
            self._read()
        except sqlite3.DatabaseError as exc:
            if self._db is not None:
                self._db.close()
                self._db = None
            raise ValueError(f"state file {self.path} is not a router state: {exc}") from exc
        return exists

    def _read(self) -> None:
        assert self._db is not None
        db = self._db
        row = db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta (key, value) VALUES ('format', ?)", (str(SCHEMA_FORMAT),))
        elif row[0] != str(SCHEMA_FORMAT):
            raise ValueError(f"state file {self.path}: unsupported format {row[0]!r}")
        # Models by name (their order means nothing: ListModels sorts), proxies in
        # registration order (a model's proxy list keeps it).
        models = [json.loads(doc) for (doc,) in db.execute("SELECT doc FROM models ORDER BY name")]
        proxies: list[dict[str, Any]] = []
        for seq, doc in db.execute("SELECT seq, doc FROM proxies ORDER BY seq"):
            proxies.append({**json.loads(doc), "seq": seq})
        pins = db.execute("SELECT session_id, proxy_id, used_at, bound_by FROM pins").fetchall()
        self.registry.load_rows(models, proxies, pins)
        admission = [
            (name, json.loads(doc)) for name, doc in db.execute("SELECT model, doc FROM admission")
        ]
        admitted = db.execute("SELECT session_id, model, ended FROM admitted").fetchall()
        self.registry.admission.load(admission, admitted, self.registry.pins)

    def _migrate_json(self) -> None:
        """The JSON state of an older router: load it, write it as a new SQLite store next
        to it, then rename that over it (atomic: a crash leaves either file whole)."""
        try:
            self.registry.load_json(json.loads(self.path.read_bytes()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"state file {self.path} is not a router state: {exc}") from exc
        tmp = self.path.with_name(f".{self.path.name}.migrating")
        for p in (tmp, *(Path(f"{tmp}{s}") for s in SIDE_FILES)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        _create_private(tmp)
        # A rollback journal, not WAL: committed means in `tmp` itself (nothing in a -wal
        # that the rename would leave behind).
        db = _connect(tmp, wal=False)
        try:
            db.execute("INSERT INTO meta (key, value) VALUES ('format', ?)", (str(SCHEMA_FORMAT),))
            self.registry.mark_all_dirty()
            _apply(db, self._collect_all())
        finally:
            db.close()
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        log.info(
            "state: migrated %s from JSON to SQLite (%d models, %d proxies, %d pins)",
            self.path,
            len(self.registry.models),
            len(self.registry.proxies),
            len(self.registry.pins),
        )

    # -- changes ------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        """Changes not yet handed to a commit."""
        return self.registry.dirty

    def _collect_all(self) -> Batch:
        batch = Batch()
        self._collect_into(batch)
        return batch

    def _collect_into(self, batch: Batch) -> None:
        """Move the registry's dirty keys into `batch` as rows (on the event loop: O(keys
        changed), small JSON documents only)."""
        reg = self.registry
        for name in reg.dirty_models:
            m = reg.models.get(name)
            batch.models[name] = json.dumps(m.to_json(), sort_keys=True) if m else None
        for pid in reg.dirty_proxies:
            p = reg.proxies.get(pid)
            batch.proxies[pid] = (p.seq, json.dumps(p.to_json(), sort_keys=True)) if p else None
        for sid in reg.dirty_pins:
            owner = reg.pins.get(sid)
            batch.pins[sid] = (
                (owner, reg.pin_used[sid], reg.bound_by.get(sid, "")) if owner is not None else None
            )
        adm = reg.admission
        for name in adm.dirty_models:
            ledger = adm.models.get(name)
            batch.admission[name] = json.dumps(ledger.to_json(), sort_keys=True) if ledger else None
        for sid in adm.dirty_sessions:
            batch.admitted[sid] = adm.session_row(sid)
        reg.dirty_models.clear()
        reg.dirty_proxies.clear()
        reg.dirty_pins.clear()
        adm.dirty_models.clear()
        adm.dirty_sessions.clear()

    async def flush(self) -> None:
        """Return once every change made before the call is committed (on disk)."""
        loop = asyncio.get_running_loop()
        if self.registry.dirty:
            if self._next is None:
                self._next = Batch()
                self._next_done = loop.create_future()
                # Nobody may be waiting when it fails (a sweep's commit): no warning then.
                self._next_done.add_done_callback(_retrieve)
            self._collect_into(self._next)
        # Our changes are in the next commit, or (when there are none) may be in the one
        # running now, whoever made them: wait for the later of the two.
        done = self._next_done if self._next is not None else self._running
        if done is None:
            return
        if self._committer is None or self._committer.done():
            self._committer = loop.create_task(self._commit_loop(), name="router-state-commit")
        # A caller that is cancelled stops waiting; the commit goes on for the others.
        await asyncio.shield(done)

    async def _commit_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._next is not None:
            batch, done = self._next, self._next_done
            assert done is not None
            self._next = self._next_done = None
            self._running = done
            try:
                await loop.run_in_executor(self._executor, self._commit, batch)
            except BaseException as exc:
                # Not on disk: write these keys again with the next commit (their current
                # values), and fail the callers waiting for this one.
                reg = self.registry
                reg.dirty_models.update(batch.models)
                reg.dirty_proxies.update(batch.proxies)
                reg.dirty_pins.update(batch.pins)
                reg.admission.dirty_models.update(batch.admission)
                reg.admission.dirty_sessions.update(batch.admitted)
                log.error("state: commit to %s failed: %s", self.path, exc)
                done.set_exception(exc if isinstance(exc, Exception) else RuntimeError(exc))
                if not isinstance(exc, Exception):
                    raise
            else:
                done.set_result(None)
            finally:
                self._running = None

    def _commit(self, batch: Batch) -> None:
        if self._db is None:
            raise RuntimeError(f"state file {self.path} is not open")
        _apply(self._db, batch)
        self.commits += 1
        self.rows_written += len(batch)

    async def close(self) -> None:
        """Commit what is left, then close the database (which checkpoints the log)."""
        if self._closed:
            return
        try:
            await self.flush()
        finally:
            self._closed = True
            if self._committer is not None:
                with contextlib.suppress(Exception):
                    await self._committer
            db, self._db = self._db, None
            if db is not None:
                await asyncio.get_running_loop().run_in_executor(self._executor, db.close)
            self._executor.shutdown(wait=True)


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


def read_state(path: str | Path) -> dict[str, Any]:
    """What a state file holds, as `Registry.to_json()` shapes it (plus each pin's last
    use): for tests and operators. Reads through SQLite, so it sees exactly what is
    committed, including what is still only in the -wal."""
    db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    try:
        models = [json.loads(doc) for (doc,) in db.execute("SELECT doc FROM models ORDER BY name")]
        proxies = [json.loads(doc) for (doc,) in db.execute("SELECT doc FROM proxies ORDER BY seq")]
        rows = db.execute(
            "SELECT session_id, proxy_id, used_at, bound_by FROM pins ORDER BY session_id"
        )
        pins: dict[str, str] = {}
        used: dict[str, float] = {}
        bound: dict[str, str] = {}
        for sid, pid, at, head in rows:
            pins[sid] = pid
            used[sid] = at
            if head:
                bound[sid] = head
    finally:
        db.close()
    return {
        "format": SCHEMA_FORMAT,
        "models": models,
        "proxies": proxies,
        "pins": pins,
        "pin_used": used,
        "bound_by": bound,
    }
