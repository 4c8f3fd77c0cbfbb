"""The stored responses (openai/responses/store.py, sqlite_store.py), both backends: bounds,
chains rebuilt from per-turn entries, ownership, deletion; the SQLite file shared by two
stores and by two processes writing at once."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sqlite3
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from areal_gateway.openai.responses.sqlite_store import SqliteStore
from areal_gateway.openai.responses.store import Entry, MemoryStore, ResponseStore
from areal_gateway.settings import Settings, SettingsError, validate


def entry(rid: str, owner: str = "o", parent: str | None = None, size: int | None = None) -> Entry:
    inputs = [{"type": "message", "role": "user", "content": f"q-{rid}"}]
    outputs = [{"type": "message", "role": "assistant", "content": f"a-{rid}"}]
    response = orjson.dumps({"id": rid, "object": "response", "status": "completed"})
    if size is None:
        size = len(orjson.dumps(inputs)) + len(orjson.dumps(outputs)) + len(response)
    return Entry(rid, owner, parent, inputs, outputs, response, size)


def texts(items: list[dict[str, Any]] | None) -> list[str]:
    assert items is not None
    return [i["content"] for i in items]


@pytest.fixture(params=["memory", "sqlite"])
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """A factory of stores of one backend (sqlite: all on one file)."""
    made: list[ResponseStore] = []

    def factory(**bounds: Any) -> Any:
        if request.param == "memory":
            store: Any = MemoryStore(**bounds)
        else:
            store = SqliteStore(str(tmp_path / "responses.db"), **bounds)
        made.append(store)
        return store

    yield factory
    for s in made:
        await s.aclose()


async def count(store: Any) -> int:
    return len(store) if isinstance(store, MemoryStore) else store.totals()[0]


async def test_bounded_by_count_and_age(make: Any) -> None:
    s = make(max_entries=2, ttl_s=60)
    for i in range(3):
        await s.put(entry(f"r{i}"))
    assert await count(s) == 2 and await s.conversation("r0", "o") is None
    assert texts(await s.conversation("r1", "o")) == ["q-r1", "a-r1"]
    assert await s.conversation("r1", "other") is None
    await s.put(entry("r3"))  # r2 is now the least recently used
    assert await s.response("r2", "o") is None and await s.response("r1", "o") is not None
    s.ttl_s = 0.05
    await asyncio.sleep(0.1)
    assert await s.conversation("r1", "o") is None and await s.response("r3", "o") is None
    await s.put(entry("r4"))  # a write drops what expired
    assert await count(s) == 1


async def test_bounded_by_bytes(make: Any) -> None:
    s = make(max_entries=100, ttl_s=60, max_bytes=1000)
    for i in range(5):
        await s.put(entry(f"r{i}", size=300))
    assert await count(s) == 3 and await s.response("r1", "o") is None
    await s.put(entry("r4", size=100))  # replaced: charged once
    assert await s.response("r4", "o") is not None and await count(s) == 3
    await s.put(entry("huge", size=2000))  # bigger than the budget: not kept, nothing evicted
    assert await s.response("huge", "o") is None and await count(s) == 3


async def test_a_chain_is_rebuilt_from_each_turns_own_items(make: Any) -> None:
    s = make()
    await s.put(entry("t0"))
    for i in range(1, 120):  # a long agent session
        await s.put(entry(f"t{i}", parent=f"t{i - 1}"))
    conv = texts(await s.conversation("t119", "o"))
    assert conv == [x for i in range(120) for x in (f"q-t{i}", f"a-t{i}")]
    # A branch from the middle sees only its own ancestors.
    await s.put(entry("b", parent="t1"))
    assert texts(await s.conversation("b", "o")) == ["q-t0", "a-t0", "q-t1", "a-t1", "q-b", "a-b"]
    # Linear storage: each entry holds its own turn only, not the conversation so far.
    if isinstance(s, SqliteStore):
        n, size = s.totals()
        assert n == 121 and size <= 121 * entry("t100").size
        rows = s._db().execute("SELECT inputs, outputs FROM responses").fetchall()
        assert all(len(orjson.loads(i)) == len(orjson.loads(o)) == 1 for i, o in rows)
    else:
        assert all(len(k.entry.inputs) == 1 for k in s._entries.values())
    # Someone else cannot continue it (nor learn of it).
    assert await s.conversation("t119", "x") is None and await s.response("t0", "x") is None


async def test_eviction_takes_a_chains_newest_turn_first(make: Any) -> None:
    s = make(max_entries=3, ttl_s=60)
    await s.put(entry("a0"))
    await s.put(entry("a1", parent="a0"))
    await s.put(entry("a2", parent="a1"))
    await s.put(entry("other"))  # one must go: the chain a0-a1-a2 loses a2, not a0
    assert await s.response("a2", "o") is None
    assert texts(await s.conversation("a1", "o")) == ["q-a0", "a-a0", "q-a1", "a-a1"]


async def test_delete_and_a_chain_through_a_deleted_turn(make: Any) -> None:
    s = make()
    await s.put(entry("d0"))
    await s.put(entry("d1", parent="d0"))
    assert not await s.delete("d0", "someone-else")
    assert await s.delete("d0", "o") and not await s.delete("d0", "o")
    assert await s.response("d0", "o") is None
    # Its continuation can still be read, but no longer continued.
    assert await s.response("d1", "o") is not None
    assert await s.conversation("d1", "o") is None


async def test_two_stores_on_one_file_share_entries(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.db")
    a, b = SqliteStore(path), SqliteStore(path)
    try:
        await a.put(entry("x0", owner="\x00admin"))
        await b.put(entry("x1", owner="\x00admin", parent="x0"))
        assert texts(await a.conversation("x1", "\x00admin")) == ["q-x0", "a-x0", "q-x1", "a-x1"]
        assert await b.delete("x0", "\x00admin")
        assert await a.response("x0", "\x00admin") is None
    finally:
        await a.aclose()
        await b.aclose()
    # Created 0600, the WAL too; a new store (a restarted gateway) finds what was kept.
    for name in ("shared.db", "shared.db-wal"):
        if (tmp_path / name).exists():
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
    c = SqliteStore(path)
    assert await c.response("x1", "\x00admin") is not None
    await c.aclose()


def _writer(path: str, prefix: str, n: int) -> None:
    store = SqliteStore(path)
    parent = None
    for i in range(n):
        rid = f"{prefix}{i}"
        store.put_now(entry(rid, parent=parent))
        parent = rid
    store._close()


def test_two_processes_write_one_file_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "procs.db")
    SqliteStore(path)._close()  # the schema, before the race
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, p, 150)) for p in ("p", "q")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = SqliteStore(path)
    try:
        assert store.totals()[0] == 300
        for prefix in ("p", "q"):
            conv = store.conversation_now(f"{prefix}149", "o")
            assert conv is not None and len(conv) == 300
        # The totals the triggers keep agree with the rows.
        n, size = store.totals()
        assert (n, size) == store._db().execute(
            "SELECT COUNT(*), SUM(size) FROM responses"
        ).fetchone()
    finally:
        store._close()


async def test_calls_do_not_block_the_event_loop(tmp_path: Path) -> None:
    """While another process holds the file's write lock, a put waits for it on the store's
    thread: the event loop goes on."""
    path = str(tmp_path / "locked.db")
    store = SqliteStore(path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    put = asyncio.ensure_future(store.put(entry("w")))
    await asyncio.sleep(0.3)
    assert not put.done() and ticks >= 5
    holder.execute("COMMIT")
    await asyncio.wait_for(put, 5)
    ticker.cancel()
    holder.close()
    assert await store.response("w", "o") is not None
    await store.aclose()


def test_the_flag_refuses_a_store_it_cannot_use(tmp_path: Path) -> None:
    base = Settings(router_addr="127.0.0.1:1", admin_api_key="k" * 20)
    for path, words in (
        (tmp_path / "missing" / "r.db", "does not exist; create it first"),
        (tmp_path, "is a folder"),
    ):
        with pytest.raises(SettingsError, match=words):
            validate(Settings(**{**base.__dict__, "response_store": str(path)}))
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is no database" * 100)
    with pytest.raises(SettingsError, match="cannot use it as a SQLite response store"):
        validate(Settings(**{**base.__dict__, "response_store": str(junk)}))
    good = tmp_path / "ok.db"
    validate(Settings(**{**base.__dict__, "response_store": str(good)}))
    assert stat.S_IMODE(os.stat(good).st_mode) == 0o600


def _endless_writer(path: str) -> None:
    store = SqliteStore(path)
    parent = None
    for i in range(1_000_000):
        store.put_now(entry(f"k{i}", parent=parent))
        parent = f"k{i}"


def test_a_writer_killed_mid_write_leaves_a_usable_file(tmp_path: Path) -> None:
    """kill -9 of a gateway while it writes: the next one opens the file, finds it whole and
    every committed turn's chain readable."""
    path = str(tmp_path / "killed.db")
    SqliteStore(path)._close()
    proc = multiprocessing.get_context("spawn").Process(target=_endless_writer, args=(path,))
    proc.start()
    probe = SqliteStore(path)
    try:
        deadline = time.monotonic() + 60
        while probe.totals()[0] < 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        probe._close()
    store = SqliteStore(path)
    try:
        db = store._db()
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        n, size = store.totals()
        assert (
            n >= 50
            and (n, size) == db.execute("SELECT COUNT(*), SUM(size) FROM responses").fetchone()
        )
        assert len(store.conversation_now(f"k{n - 1}", "o") or ()) == 2 * n
        store.put_now(entry(f"k{n}", parent=f"k{n - 1}"))  # and it goes on
        assert len(store.conversation_now(f"k{n}", "o") or ()) == 2 * (n + 1)
    finally:
        store._close()
