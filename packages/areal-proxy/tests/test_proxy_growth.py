"""Bounded growth: a turn stores only what is new (and reads back whole), ended and exported
sessions are deleted after --retention-seconds; an old database still reads."""

from __future__ import annotations

import sqlite3
import time

import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, start

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.common.records import Interaction
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.recording.store import Store
from areal_runtime.session_keys import mint_key, new_id

ADMIN = envelope_pb2.Envelope(api_key="admin", is_admin=True)


async def _export(h, sid, style):
    rows = []
    async for chunk in h.stub.ExportTrajectories(
        proxy_pb2.ExportTrajectoriesRequest(
            session_ids=[sid], style=style, discount=0.5, envelope=ADMIN
        )
    ):
        rows.extend(orjson.loads(line) for line in chunk.jsonl.splitlines())
    return rows


async def _conversation(h, turns: int):
    sid = new_id("sess")
    key = mint_key(sid)
    creds = [proxy_pb2.SessionCredentials(session_id=sid, session_api_key=key)]
    await h.stub.StartSessions(
        proxy_pb2.StartSessionsRequest(task_id="t", group_id=new_id("g"), sessions=creds)
    )
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q 0"}]
    for turn in range(turns):
        h.engine._prompt_len = None  # each turn is a new request to the fake, not a resume
        r = await h.chat({"messages": msgs, "max_tokens": 4}, api_key=key, session_id=sid)
        await h.stub.SetReward(
            proxy_pb2.SetRewardRequest(session_id=sid, reward=float(turn), envelope=ADMIN)
        )
        msgs = [
            *msgs,
            {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"question number {turn + 1}, please answer"},
        ]
    return sid


def _stored_sizes(store: Store, sid: str) -> list[tuple[int, int]]:
    return store._db.execute(
        "SELECT length(messages), length(prompt_ids) FROM interactions "
        "WHERE session_id = ? ORDER BY seq",
        (sid,),
    ).fetchall()


@pytest.mark.parametrize("template", ["hf", "concat"])
async def test_a_turn_stores_what_is_new_and_reads_back_whole(template):
    h = await start(
        FakeEngineClient([7, 8, EOS]),
        chat_template_type=template,
        set_reward_finish_timeout=3600.0,
        proxy_id="p-rec",
    )
    try:
        turns = 40
        sid = await _conversation(h, turns)
        recs = h.records
        sizes = _stored_sizes(h.server.store, sid)
        # Flat: the last turn stores no more than the second (the conversation grew 20x).
        assert sizes[-1][0] <= sizes[1][0] + 8, sizes
        assert sizes[-1][1] <= sizes[1][1] + 16, sizes
        # Read back whole and exactly: every row, and every parent lookup by id.
        rows = await _export(h, sid, "individual")
        assert [r["input_ids"] for r in rows] == [r.prompt_ids + r.token_ids for r in recs]
        # One replica, this proxy, named: one pair at each row's first generated token.
        assert [r["replicas"] for r in rows] == [[[len(x.prompt_ids), "p-rec"]] for x in recs]
        assert [r["logprobs"][len(x.prompt_ids) :] for r, x in zip(rows, recs, strict=True)] == [
            x.logprobs for x in recs
        ]
        whole = h.server.store.interactions(sid)
        assert len(orjson.dumps(whole[-1].messages)) > 10 * sizes[-1][0]
        assert len(whole[-1].prompt_ids) * 4 > 10 * sizes[-1][1]
        for it, rec in zip(whole, recs, strict=True):
            one = h.server.store.interaction(it.interaction_id)
            assert one is not None and one.prompt_ids == rec.prompt_ids
            assert one.messages == it.messages
            assert len(it.messages) == 2 + 2 * it.seq
        if template == "concat":
            [row] = await _export(h, sid, "concat")
            assert row["input_ids"] == recs[-1].prompt_ids + recs[-1].token_ids
            assert len(row["interaction_ids"]) == turns
            assert row["replicas"] == [[len(recs[0].prompt_ids), "p-rec"]]
        # A session evicted from memory reloads its lineage from the stored parts: the next
        # turn finds its parent (the last turn) again.
        book = h.server.book
        book._live.clear()
        conv = h.server.store.conversations(sid)
        last = whole[-1]
        assert conv[-1][2] == last.messages
        turn = book.begin_turn(
            book.store.session(sid),
            [*last.messages, last.response, {"role": "user", "content": "more"}],
        )
        assert turn.parent is not None and turn.parent.interaction_id == last.interaction_id
        assert turn.parent.prompt_ids == recs[-1].prompt_ids
    finally:
        await h.close()


def test_a_database_from_before_reads_and_takes_new_turns(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    # The schema as first shipped (no shared_* columns, no exported_at).
    db.executescript(
        """
        CREATE TABLE sessions (session_id TEXT PRIMARY KEY, group_id TEXT NOT NULL,
          task_id TEXT NOT NULL, key_hash TEXT NOT NULL, model TEXT NOT NULL,
          created_at REAL NOT NULL, last_active_at REAL NOT NULL, ended_at REAL,
          last_reward_at REAL, n_interactions INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE interactions (interaction_id TEXT PRIMARY KEY, session_id TEXT NOT NULL,
          seq INTEGER NOT NULL, parent_id TEXT, messages BLOB NOT NULL, response BLOB NOT NULL,
          prompt_ids BLOB NOT NULL, output_ids BLOB NOT NULL, logprobs BLOB NOT NULL,
          versions BLOB NOT NULL, finish_reason TEXT NOT NULL, reward REAL,
          created_at REAL NOT NULL, finished_at REAL NOT NULL, timings BLOB NOT NULL,
          inherited INTEGER NOT NULL DEFAULT 0, UNIQUE (session_id, seq));
        INSERT INTO sessions VALUES ('s1', 'g', 't', 'h', 'm', 1, 1, NULL, NULL, 1);
        """
    )
    from array import array

    msgs = [{"role": "user", "content": "hi"}]
    db.execute(
        "INSERT INTO interactions VALUES ('i0','s1',0,NULL,?,?,?,?,?,?,'stop',NULL,1,2,'{}',0)",
        (
            orjson.dumps(msgs),
            orjson.dumps({"role": "assistant", "content": "yo"}),
            array("i", [1, 2, 3]).tobytes(),
            array("i", [4]).tobytes(),
            array("d", [-0.5]).tobytes(),
            array("i", [0]).tobytes(),
        ),
    )
    db.commit()
    db.close()
    store = Store(path)
    [old] = store.interactions("s1")
    assert (old.prompt_ids, old.output_ids, old.messages) == ([1, 2, 3], [4], msgs)
    # No replicas recorded: all its tokens are the recording proxy's (one run in a row).
    assert old.replicas == []
    conv = [*msgs, old.response, {"role": "user", "content": "more"}]
    new = Interaction("i1", "s1", 1, conv, {}, [1, 2, 3, 4, 9], [5, 6], [-0.1] * 2, [0, 0], "stop")
    new.parent_id, new.replicas = "i0", [(0, "p-old"), (1, "p2")]
    new.shared_tokens, new.shared_messages = 4, 2
    store.add_interaction(new)
    assert store.interaction("i1").prompt_ids == [1, 2, 3, 4, 9]
    assert store.interaction("i1").messages == conv
    assert store.interaction("i1").replicas == [(0, "p-old"), (1, "p2")]
    book = SessionBook(store, proxy_id="p-old")
    rows = list(book.export_rows([store.session("s1")], "individual", 1.0))
    assert [r["replicas"] for r in rows] == [[[3, "p-old"]], [[5, "p-old"], [6, "p2"]]]
    # Recorded before call kinds, tool counts and prompt hashes: unmarked, no calls, and
    # exported uncertified (an empty hash) rather than refused.
    assert [r["spans"] for r in rows] == [[[3, 4, ""]], [[5, 7, ""]]]
    assert [(r["chain_reason"], r["side"]) for r in rows] == [
        ("root", False),
        ("retokenized", False),
    ]
    assert rows[0]["tool_calls"] == {"declared": 0, "called": 0, "parsed": 0}


def test_ended_exported_sessions_are_deleted_after_retention(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    book = SessionBook(store, ttl=60, retention=100.0)
    now = time.time()
    ids = {name: new_id("sess") for name in ("done", "not_exported", "not_ended")}
    book.start("g", "t", "m", [(sid, mint_key(sid)) for sid in ids.values()])
    for sid in ids.values():
        store.add_interaction(Interaction(new_id("int"), sid, 0, [], {}, [1], [2], [0.0], [0], "x"))
    book.end([ids["done"], ids["not_exported"]])
    book.exported([store.session(ids["done"]), store.session(ids["not_ended"])])
    assert book.purge(now + 50) == []
    assert book.purge(now + 150) == [ids["done"]]
    assert store.session(ids["done"]) is None
    assert store.session(ids["not_exported"]) and store.session(ids["not_ended"])
    assert store.interaction_count() == 2
    # 0 keeps them until an export removes them.
    book.retention = 0
    book.end([ids["not_ended"]])
    book.exported([store.session(ids["not_ended"])])
    assert book.purge(now + 10**6) == []


async def test_export_starts_retention_and_the_expiry_pass_deletes(monkeypatch):
    h = await start(FakeEngineClient([7, EOS]), retention_seconds=30.0)
    try:
        sid = await _conversation(h, 1)
        await _export(h, sid, "individual")
        await h.stub.EndSessions(proxy_pb2.EndSessionsRequest(session_ids=[sid], envelope=ADMIN))
        await h.server.expire_once()
        assert h.server.store.session(sid) is not None  # within retention
        later = time.time() + 60
        monkeypatch.setattr(time, "time", lambda: later)
        await h.server.expire_once()
        assert h.server.store.session(sid) is None
        assert h.server.store.interaction_count() == 0
    finally:
        await h.close()


async def test_a_long_sessions_export_streams_in_chunks_under_the_message_limit():
    h = await start(FakeEngineClient([7, EOS]))
    try:
        sid = await _conversation(h, 1)
        store = h.server.store
        ids = list(range(100_000))  # a long turn: ~1.5 MB of JSON per row
        for seq in range(1, 21):
            it = Interaction(new_id("int"), sid, seq, [], {}, ids, [1], [0.0], [0], "stop")
            store.add_interaction(it)
        sizes, rows = [], 0
        async for chunk in h.stub.ExportTrajectories(
            proxy_pb2.ExportTrajectoriesRequest(
                session_ids=[sid], style="individual", discount=1.0, envelope=ADMIN
            )
        ):
            sizes.append(len(chunk.jsonl))
            rows += chunk.rows
        assert rows == 21
        # 256 rows a chunk made this one 30 MB message (a longer session passed gRPC's limit).
        assert len(sizes) > 1 and max(sizes) < 4 * 1024 * 1024, sizes
    finally:
        await h.close()
