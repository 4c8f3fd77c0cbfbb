"""Tree sessions and certified spans: one row per chain of exactly continued turns, each
naming why it started and where it came from; side calls marked (by header or by default)
and chosen at export; every trained span carrying the hash of the prompt it was sampled
under, a corrupted stored turn refused and its chain split; tool-call parsing counted."""

from __future__ import annotations

import hashlib
from typing import Any

import grpc
import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, error_detail, start
from test_proxy_sessions import ADMIN, _export, _group

from areal_client.spans import prompt_hash, uncertified_spans
from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.common.records import Interaction, Session
from areal_proxy.recording import chains
from areal_proxy.recording.export import rows as export_rows
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.recording.spans import pack_ids
from areal_proxy.recording.spans import prompt_hash as proxy_prompt_hash
from areal_proxy.recording.store import Store
from areal_runtime.session_keys import mint_key

SESSION = Session("s1", "g1", "t1", "h", "m", 0.0, 0.0)


def _turn(
    iid: str,
    seq: int,
    prompt: list[int],
    out: list[int],
    *,
    parent: Interaction | None = None,
    exact: bool = True,
    tools: int = 0,
    kind: str = "",
    path: str = "",
    created: float | None = None,
    calls: tuple[int, int] = (0, 0),
) -> Interaction:
    """A recorded turn; with `parent` and `exact`, its prompt is the parent's prompt + output
    followed by `prompt` (it continues the parent's exact ids)."""
    inherited = 0
    if parent is not None and exact:
        inherited = len(parent.prompt_ids) + len(parent.output_ids)
        prompt = parent.prompt_ids + parent.output_ids + prompt
    return Interaction(
        interaction_id=iid,
        session_id="s1",
        seq=seq,
        messages=[{"role": "user", "content": iid}],
        response={"role": "assistant", "content": iid},
        prompt_ids=prompt,
        output_ids=out,
        logprobs=[-0.25] * len(out),
        versions=[1] * len(out),
        finish_reason="stop",
        parent_id=parent.interaction_id if parent is not None else None,
        created_at=seq * 10.0 if created is None else created,
        finished_at=seq * 10.0 + 5,
        inherited=inherited,
        prompt_path=path,
        call_kind=kind,
        tools_declared=tools,
        tool_calls_made=calls[0],
        tool_calls_parsed=calls[1],
        prompt_hash=proxy_prompt_hash(prompt),
    )


def _rows(turns: list[Interaction], style: str = "concat", side_calls: str = "include"):
    return list(export_rows([(SESSION, turns)], style, 1.0, "p1", side_calls))


def _chain(row: dict[str, Any]) -> tuple[str, str, str, bool]:
    return row["chain_id"], row["chain_reason"], row["parent_chain"], row["side"]


def _harness_session() -> list[Interaction]:
    """A coding agent's session: its main conversation with tools, a title call started with
    it (no tools), a sub-agent (its own conversation, with tools), a retried turn (a fork),
    and a turn whose parent was rendered into other ids."""
    m0 = _turn("m0", 0, [1, 2], [3, 4], tools=2, path="full", calls=(1, 1))
    t1 = _turn("t1", 1, [1, 9], [8], path="full", created=0.5)
    m2 = _turn("m2", 2, [5], [6, 7], parent=m0, tools=2, path="incremental", calls=(2, 1))
    s3 = _turn("s3", 3, [50, 51], [52], tools=1, path="full:history_edited", calls=(1, 1))
    m4 = _turn("m4", 4, [11], [12], parent=m2, tools=2, path="incremental")
    f5 = _turn("f5", 5, [13], [14], parent=m2, tools=2, path="incremental")
    r6 = _turn("r6", 6, [50, 51, 99, 53], [54], parent=s3, exact=False, tools=1)
    r6.prompt_path = "incremental"
    return [m0, t1, m2, s3, m4, f5, r6]


def test_a_harness_session_exports_one_row_per_chain() -> None:
    turns = _harness_session()
    rows = _rows(turns)
    # In the order of each chain's last turn.
    assert [r["interaction_ids"] for r in rows] == [
        ["t1"],
        ["s3"],
        ["m0", "m2", "m4"],
        ["f5"],
        ["r6"],
    ]
    assert [_chain(r) for r in rows] == [
        # Started before any turn was recorded: a root too; no tools while others have some.
        ("t1", "root", "", True),
        # The sub-agent: its own conversation, after the main one's second turn.
        ("s3", "history_edited", "m0", False),
        ("m0", "root", "", False),
        # A second turn continuing m2: m2's output is trained once, in the main chain.
        ("f5", "fork", "m0", False),
        ("r6", "retokenized", "s3", False),
    ]
    main = rows[2]
    m0, m2, m4 = turns[0], turns[2], turns[4]
    assert main["input_ids"] == m4.prompt_ids + m4.output_ids
    assert main["spans"] == [
        [len(t.prompt_ids), len(t.prompt_ids) + len(t.output_ids), prompt_hash(t.prompt_ids)]
        for t in (m0, m2, m4)
    ]
    assert uncertified_spans(main["input_ids"], main["spans"]) == []
    assert main["tool_calls"] == {"declared": 2, "called": 3, "parsed": 2}
    fork = rows[3]
    assert fork["loss_mask"] == [0] * len(turns[5].prompt_ids) + [1]
    assert fork["spans"] == [
        [len(turns[5].prompt_ids), len(fork["input_ids"]), turns[5].prompt_hash]
    ]


def test_individual_rows_name_their_chain_in_the_order_recorded() -> None:
    rows = _rows(_harness_session(), "individual")
    assert [r["interaction_id"] for r in rows] == ["m0", "t1", "m2", "s3", "m4", "f5", "r6"]
    assert [r["chain_id"] for r in rows] == ["m0", "t1", "m0", "s3", "m0", "f5", "r6"]
    for r in rows:
        [(start, end, phash)] = r["spans"]
        assert (start, end) == (r["loss_mask"].index(1), len(r["input_ids"]))
        assert phash == prompt_hash(r["input_ids"][:start])


@pytest.mark.parametrize(
    ("side_calls", "ids"),
    [
        ("include", ["t1", "s3", "m0", "f5", "r6"]),
        ("exclude", ["s3", "m0", "f5", "r6"]),
        ("only", ["t1"]),
    ],
)
def test_the_export_chooses_side_calls(side_calls: str, ids: list[str]) -> None:
    rows = _rows(_harness_session(), side_calls=side_calls)
    assert [r["chain_id"] for r in rows] == ids


def test_a_marked_call_overrides_the_default_and_never_joins_a_chain_marked_otherwise() -> None:
    m0 = _turn("m0", 0, [1, 2], [3], tools=1, path="full")
    # A summary request continuing the main conversation exactly, marked side: its own chain.
    s1 = _turn("s1", 1, [4], [5], parent=m0, tools=1, kind="side")
    # Another side-marked turn continuing it: the same side chain.
    s2 = _turn("s2", 2, [6], [7], parent=s1, tools=1, kind="side")
    # An unmarked turn continuing the side chain: it goes on in it.
    s3 = _turn("s3", 3, [8], [9], parent=s2, tools=1)
    # A main-marked turn continuing the side chain: a chain of its own.
    m4 = _turn("m4", 4, [10], [11], parent=s3, tools=1, kind="main")
    # No tools but marked main: trained; no tools and unmarked: a side call by default.
    t5 = _turn("t5", 5, [20], [21], kind="main", path="full:history_edited")
    t6 = _turn("t6", 6, [22], [23], path="full:history_edited")
    rows = _rows([m0, s1, s2, s3, m4, t5, t6])
    assert {r["chain_id"]: (r["interaction_ids"], r["chain_reason"], r["side"]) for r in rows} == {
        "m0": (["m0"], "root", False),
        "s1": (["s1", "s2", "s3"], "side_call", True),
        "m4": (["m4"], "main_call", False),
        "t5": (["t5"], "history_edited", False),
        "t6": (["t6"], "history_edited", True),
    }
    assert [r["parent_chain"] for r in rows if r["chain_id"] in ("s1", "m4")] == ["m0", "s1"]


def test_without_tools_anywhere_nothing_is_a_side_call_by_default() -> None:
    a = _turn("a", 0, [1], [2], path="full")
    b = _turn("b", 1, [3], [4], path="full:history_edited")
    assert [r["side"] for r in _rows([a, b])] == [False, False]


# --- certified spans: a turn stored wrongly is never exported as if exact -----------------


def _recorded(tmp_path) -> tuple[Store, SessionBook, list[Interaction]]:
    """Three turns continuing each other, recorded by the book (which takes each prompt's
    hash) into SQLite, each storing only its own ids beyond its parent's."""
    store = Store(tmp_path / "rec.db")
    book = SessionBook(store, proxy_id="p1")
    book.start("g1", "t1", "m", [("s1", mint_key("s1"))])
    turns: list[Interaction] = []
    parent = None
    for i, (new, out) in enumerate((([1, 2, 3], [4, 5]), ([6], [7, 8]), ([9, 10], [11]))):
        it = _turn(f"c{i}", i, new, out, parent=parent)
        it.prompt_hash = ""  # the book takes it
        if parent is not None:
            it.shared_tokens = it.inherited
        book.record_now(it)
        turns.append(it)
        parent = it
    return store, book, turns


def _export_all(book: SessionBook, store: Store, style: str = "concat"):
    session = store.session("s1")
    assert session is not None
    return list(book.export_rows([session], style, 1.0))


def test_the_book_hashes_each_prompt_as_recorded(tmp_path) -> None:
    store, book, turns = _recorded(tmp_path)
    # The later turns were hashed from the turn before's hasher: the same as hashing whole.
    assert [t.prompt_hash for t in store.interactions("s1")] == [
        prompt_hash(t.prompt_ids) for t in turns
    ]
    [row] = _export_all(book, store)
    assert row["interaction_ids"] == ["c0", "c1", "c2"]
    assert len(row["spans"]) == 3 and uncertified_spans(row["input_ids"], row["spans"]) == []


def test_a_corrupted_stored_turn_is_refused_and_the_rest_of_its_chain_with_it(tmp_path) -> None:
    store, book, turns = _recorded(tmp_path)
    # c1's own prompt ids (beyond c0's prompt + output) changed on disk; c2 is read back on
    # top of them, so its prefix is no longer what it was sampled under either.
    store._db.execute(
        "UPDATE interactions SET prompt_ids = ? WHERE interaction_id = 'c1'", (pack_ids([66]),)
    )
    assert store.interaction("c2").prompt_ids[5] == 66
    [row] = _export_all(book, store)
    assert row["interaction_ids"] == ["c0"]
    assert row["input_ids"] == turns[0].prompt_ids + turns[0].output_ids
    assert uncertified_spans(row["input_ids"], row["spans"]) == []
    assert [r["interaction_id"] for r in _export_all(book, store, "individual")] == ["c0"]


def test_a_turn_whose_certificate_fails_splits_its_chain(tmp_path) -> None:
    store, book, turns = _recorded(tmp_path)
    store._db.execute(
        "UPDATE interactions SET prompt_hash = ? WHERE interaction_id = 'c1'", ("0" * 32,)
    )
    rows = _export_all(book, store)
    assert [(r["interaction_ids"], r["chain_reason"], r["parent_chain"]) for r in rows] == [
        (["c0"], "root", ""),
        # c2's prefix is still what it was sampled under: trained, as a chain of its own.
        (["c2"], "prefix_mismatch", "c0"),
    ]
    c2 = turns[2]
    assert rows[1]["loss_mask"] == [0] * len(c2.prompt_ids) + [1]
    assert uncertified_spans(rows[1]["input_ids"], rows[1]["spans"]) == []


def test_the_client_finds_a_row_changed_after_export() -> None:
    m0, _, m2 = _harness_session()[:3]
    [row] = _rows([m0, m2])
    assert uncertified_spans(row["input_ids"], row["spans"]) == []
    bad = list(row["input_ids"])
    bad[len(m0.prompt_ids)] += 1  # m0's first sampled token: inside m2's prompt only
    assert uncertified_spans(bad, row["spans"]) == [tuple(row["spans"][1])]
    assert uncertified_spans(row["input_ids"], [[2, 4, ""]]) == [(2, 4, "")]


def test_the_proxy_and_the_client_hash_alike() -> None:
    for ids in ([], [0], [1, 2, 3], [151643, 2**31 - 1, 70000]):
        assert proxy_prompt_hash(ids) == prompt_hash(ids)
    # The definition itself: BLAKE2b-128 of int32 little-endian.
    packed = b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert prompt_hash([1, 256]) == hashlib.blake2b(packed, digest_size=16).hexdigest()


def test_chains_are_built_once_per_turn_order() -> None:
    # The order recorded decides which continuation goes on in the chain: the first.
    turns = _harness_session()
    built = chains.build(turns)
    assert [c.chain_id for c in built] == ["m0", "t1", "s3", "f5", "r6"]
    assert [t.interaction_id for t in built[0].turns] == ["m0", "m2", "m4"]


# --- over gRPC: the marker, tool-call counts, the export's choice ---------------------------

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
GOOD = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
# Not JSON inside the markers: the parser leaves it in the content.
BAD = "<tool_call>get_time(tz=UTC)</tool_call>"


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_made_and_parsed_are_counted_per_row(stream: bool) -> None:
    engine = FakeEngineClient([])
    h = await start(engine, tool_call_parser="hermes")
    try:
        engine.sequence = [*h.tok.encode("Sure." + GOOD + BAD), EOS]
        [(sid, key)] = await _group(h)
        body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
        if stream:
            await h.chat_stream({**body, "stream": True}, api_key=key, session_id=sid)
        else:
            reply = await h.chat(body, api_key=key, session_id=sid)
            assert len(reply["choices"][0]["message"]["tool_calls"]) == 1
            assert "<tool_call>" in reply["choices"][0]["message"]["content"]
        # A request without tools: nothing declared, nothing parsed.
        engine.sequence = [*h.tok.encode(GOOD), EOS]
        await h.chat({"messages": [{"role": "user", "content": "hi"}]}, api_key=key, session_id=sid)
        rows = await _export(h, session_ids=[sid], style="individual")
        assert [r["tool_calls"] for r in rows] == [
            {"declared": 2, "called": 2, "parsed": 1},
            {"declared": 0, "called": 0, "parsed": 0},
        ]
    finally:
        await h.close()


async def test_the_call_marker_is_recorded_and_the_export_chooses() -> None:
    engine = FakeEngineClient([7, EOS])
    h = await start(engine)
    try:
        [(sid, key)] = await _group(h)
        main = await h.chat(
            {"messages": [{"role": "user", "content": "task"}]}, api_key=key, session_id=sid
        )
        title = await h.chat(
            {"messages": [{"role": "user", "content": "a title?"}]},
            api_key=key,
            session_id=sid,
            call_kind="side",
        )
        assert h.server.book.store.interaction(title["id"]).call_kind == "side"
        every = await _export(h, session_ids=[sid])
        assert [(r["interaction_id"], r["side"]) for r in every] == [
            (main["id"], False),
            (title["id"], True),
        ]
        for choice, ids in (("exclude", [main["id"]]), ("only", [title["id"]])):
            rows = []
            async for chunk in h.stub.ExportTrajectories(_export_request(sid, side_calls=choice)):
                rows += [r for r in chunk.jsonl.splitlines() if r]
            assert [orjson.loads(r)["interaction_id"] for r in rows] == ids
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in h.stub.ExportTrajectories(_export_request(sid, side_calls="some")):
                pass
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_detail(ei.value).param == "side_calls"
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.chat(
                {"messages": [{"role": "user", "content": "x"}]},
                api_key=key,
                session_id=sid,
                call_kind="title",
            )
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_detail(ei.value).param == "x-areal-call"
    finally:
        await h.close()


def _export_request(sid: str, **kw: Any) -> proxy_pb2.ExportTrajectoriesRequest:
    return proxy_pb2.ExportTrajectoriesRequest(
        session_ids=[sid], discount=1.0, envelope=ADMIN, **kw
    )


def test_a_title_call_recorded_first_is_no_parent_of_the_main_conversation() -> None:
    # OpenCode's title call (no tools) can finish before its first main turn starts: the main
    # conversation is still the session's root, not a chain that came from the title.
    t0 = _turn("t0", 0, [1, 9], [8], path="full")
    m1 = _turn("m1", 1, [1, 2], [3], tools=2, path="full:new_conversation")
    m2 = _turn("m2", 2, [4], [5], parent=m1, tools=2, path="incremental")
    s3 = _turn("s3", 3, [60], [61], tools=1, path="full:new_conversation")
    rows = _rows([t0, m1, m2, s3])
    assert [_chain(r) for r in rows] == [
        ("t0", "root", "", True),
        ("m1", "root", "", False),
        # A later sub-agent's parent is the main conversation, never the title call.
        ("s3", "new_conversation", "m1", False),
    ]
