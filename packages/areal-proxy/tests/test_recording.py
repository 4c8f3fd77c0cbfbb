"""Recording: SQLite store, lineage, export styles, session rules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_proxy.common.records import Interaction, Session
from areal_proxy.prompt.concat import continue_tokens
from areal_proxy.recording.export import concat_rows, discounted_rewards, individual_rows
from areal_proxy.recording.lineage import Lineage
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.recording.store import Store
from areal_runtime.errors import ServiceError
from areal_runtime.session_keys import mint_key, new_id, session_of


def _it(
    sid, seq, prompt, output, *, parent=None, inherited=0, reward=None, versions=None, msgs=None
):
    return Interaction(
        interaction_id=f"i{seq}",
        session_id=sid,
        seq=seq,
        messages=msgs or [{"role": "user", "content": str(seq)}],
        response={"role": "assistant", "content": f"a{seq}"},
        prompt_ids=prompt,
        output_ids=output,
        logprobs=[-0.5] * len(output),
        versions=versions or [0] * len(output),
        finish_reason="stop",
        parent_id=parent,
        reward=reward,
        created_at=1.0,
        finished_at=2.0,
        inherited=inherited,
    )


def _new(sid, seq, prompt, output, **kw):
    """A finished turn not yet recorded: the book assigns its id and number."""
    it = _it(sid, seq, prompt, output, **kw)
    it.interaction_id = ""
    return it


def _session(sid="s1"):
    return Session(sid, "g1", "t1", "h", "m", 1.0, 1.0)


def test_store_round_trip_keeps_exact_tokens_and_floats(tmp_path):
    st = Store(tmp_path / "rec.db")
    st.add_sessions([_session()])
    it = _it("s1", 0, [1, 2, 3], [70000, 5])
    it.logprobs = [-1.2345678901234567, -1e-9]
    st.add_interaction(it)
    back = st.interactions("s1")[0]
    assert back == it
    assert st.session("s1").n_interactions == 1
    assert oct(os.stat(tmp_path / "rec.db").st_mode & 0o777) == "0o600"


def test_store_keeps_which_replica_made_which_tokens_per_interaction(tmp_path):
    st = Store(tmp_path / "rec.db")
    st.add_sessions([_session()])
    # A migrated turn: p1 made 2 tokens, then p2 the rest; its child shares the parent's
    # prompt + output (stored as shared tokens) but names only its own output's replica.
    it = _it("s1", 0, [1, 2], [3, 4, 5, 6])
    it.replicas = [(0, "p1"), (2, "p2")]
    child = _it("s1", 1, [1, 2, 3, 4, 5, 6, 9], [7], parent="i0", inherited=6)
    child.replicas = [(0, "p1")]
    child.shared_tokens = 6
    st.add_interaction(it)
    st.add_interaction(child)
    back = st.interactions("s1")
    assert [b.replicas for b in back] == [[(0, "p1"), (2, "p2")], [(0, "p1")]]
    assert back == [it, child]
    assert st.interaction("i0").replicas == [(0, "p1"), (2, "p2")]
    assert st.interaction("i1").replicas == [(0, "p1")]
    assert st.interaction("i1").prompt_ids == [1, 2, 3, 4, 5, 6, 9]


def _migrated(sid, seq, prompt, output, runs, **kw):
    it = _it(sid, seq, prompt, output, **kw)
    it.replicas = runs
    return it


def test_individual_rows_say_which_replica_made_which_token():
    turns = [
        _migrated("s1", 0, [1, 2, 3], [4, 5, 6, 7], [(0, "p1"), (1, "p2"), (3, "p3")], reward=1.0),
        # recorded before migration existed: all by the recording proxy
        _it("s1", 1, [1], [2, 3]),
        # a run that made no token (p2 answered only the finish) is no run of the row
        _migrated("s1", 2, [1], [2, 3], [(0, "p1"), (2, "p2")]),
    ]
    rows = list(individual_rows(_session(), turns, 0.5, "p1"))
    assert [r["replicas"] for r in rows] == [
        [[3, "p1"], [4, "p2"], [6, "p3"]],
        [[1, "p1"]],
        [[1, "p1"]],
    ]
    # Each pair starts at a generated position; rewards and masks are as without replicas.
    row = rows[0]
    assert all(row["loss_mask"][i] == 1 for i, _ in row["replicas"])
    assert row["loss_mask"] == [0, 0, 0, 1, 1, 1, 1]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 0.0]


def test_concat_rows_shift_each_turns_replicas_to_its_output():
    t0 = _migrated("s1", 0, [1, 2], [3, 4], [(0, "p1"), (1, "p2")])
    # goes on on p2 (its first run is p2's: one run across the template text between them)
    t1 = _migrated(
        "s1", 1, [1, 2, 3, 4, 9], [5, 6], [(0, "p2"), (1, "p1")], parent="i0", inherited=4
    )
    t2 = _it("s1", 2, [1, 2, 3, 4, 9, 5, 6, 9], [7], parent="i1", inherited=7, reward=1.0)
    [row] = concat_rows(_session(), [t0, t1, t2], 0.5, "p9")
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 1, 1, 0, 1]
    assert row["replicas"] == [[2, "p1"], [3, "p2"], [6, "p1"], [8, "p9"]]
    assert row["reward"] == 1.0
    # One replica for the whole chain: one pair, at the first generated position.
    one = [
        _it("s1", 0, [1, 2], [3, 4]),
        _it("s1", 1, [1, 2, 3, 4, 9], [5], parent="i0", inherited=4),
    ]
    [row] = concat_rows(_session(), one, 1.0, "p9")
    assert row["replicas"] == [[2, "p9"]]


async def test_a_recorded_turn_names_this_proxy_for_its_own_engines_tokens(tmp_path):
    from areal_proto.common.v1.envelope_pb2 import Envelope
    from areal_proxy.generation.controller import GenerationRecord
    from areal_proxy.recording.recorder import Recorder

    book = SessionBook(Store(tmp_path / "r.db"), proxy_id="p1")
    sid = new_id("sess")
    key = mint_key(sid)
    book.start("g1", "t1", "m", [(sid, key)])
    rec = GenerationRecord(rid="r", prompt_ids=[1, 2], max_new_tokens=8)
    rec.add([3, 4], [-0.1, -0.2], [[], []], 1)
    rec.add([5], [-0.3], [[]], 2, replica="p2")
    rec.add([6], [-0.4], [[]], 2)
    recorder = Recorder(book)
    ot = await recorder.begin(Envelope(session_id=sid, api_key=key), None, "i-1")
    assert ot is not None
    await recorder.commit(ot, messages="q", response="a", rec=rec, finish_reason="stop")
    [it] = book.store.interactions(sid)
    assert it.replicas == [(0, "p1"), (2, "p2"), (3, "p1")]
    [row] = book.export_rows([book.store.session(sid)], "individual", 1.0)
    assert row["replicas"] == [[2, "p1"], [4, "p2"], [5, "p1"]]
    assert row["versions"] == [-1, -1, 1, 1, 2, 2]


def test_acknowledged_writes_survive_sigkill(tmp_path):
    db = tmp_path / "rec.db"
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path[:0] = {sys.path!r}
        from areal_proxy.recording.store import Store
        from areal_proxy.common.records import Session, Interaction
        st = Store({str(db)!r})
        st.add_sessions([Session("s1", "g", "t", "h", "m", 1.0, 1.0)])
        st.add_interaction(Interaction("i0", "s1", 0, [], "x", [1, 2], [3], [-0.1], [0], "stop"))
        st.set_reward("s1", "i0", 1.5, 3.0)
        print("acked", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL and "acked" in proc.stdout
    st = Store(db)
    [it] = st.interactions("s1")
    assert (it.output_ids, it.reward) == ([3], 1.5)


def test_lineage_finds_longest_prefix_parent():
    lin = Lineage()
    u1 = {"role": "user", "content": "hi"}
    a1 = {"role": "assistant", "content": "hello", "reasoning_content": "dropped by clients"}
    lin.add("i0", [u1], a1)
    u2 = {"role": "user", "content": "more"}
    a2 = {"role": "assistant", "content": "sure"}
    lin.add(
        "i1", [u1, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}, u2], a2
    )
    assert lin.parent_of([u1]) == (None, 0)
    assert lin.parent_of([u1, {"role": "assistant", "content": "hello"}, u2]) == ("i0", 2)
    conv = [u1, {"role": "assistant", "content": "hello"}, u2, a2, {"role": "user", "content": "x"}]
    assert lin.parent_of(conv) == ("i1", 4)
    assert lin.parent_of([{"role": "user", "content": "other"}]) == (None, 0)


def test_discount_walks_back_over_turns():
    turns = [
        _it("s", 0, [1], [2]),
        _it("s", 1, [1], [2], reward=0.0),
        _it("s", 2, [1], [2], reward=1.0),
    ]
    assert discounted_rewards(turns, 0.5) == [0.25, 0.5, 1.0]
    assert discounted_rewards(turns, 1.0) == [1.0, 1.0, 1.0]
    assert discounted_rewards(turns, 0.0) == [0.0, 0.0, 1.0]


def test_individual_rows_masks_and_versions():
    turns = [_it("s1", 0, [1, 2], [3, 4], versions=[0, 1], reward=2.0)]
    [row] = individual_rows(_session(), turns, 1.0)
    assert row["input_ids"] == [1, 2, 3, 4]
    assert row["loss_mask"] == [0, 0, 1, 1]
    assert row["logprobs"] == [0.0, 0.0, -0.5, -0.5]
    assert row["versions"] == [-1, -1, 0, 1]
    assert (row["reward"], row["group_id"], row["task_id"]) == (2.0, "g1", "t1")


def test_concat_rows_lay_turns_on_one_token_stream():
    t0 = _it("s1", 0, [1, 2], [3, 4])
    t1 = _it("s1", 1, [1, 2, 3, 4, 9], [5], parent="i0", inherited=4, versions=[1])
    t2 = _it("s1", 2, [1, 2, 3, 4, 9, 5, 9], [6, 7], parent="i1", inherited=6, reward=1.0)
    [row] = concat_rows(_session(), [t0, t1, t2], 0.5)
    assert row["input_ids"] == [1, 2, 3, 4, 9, 5, 9, 6, 7]
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 1, 0, 1, 1]
    assert row["versions"] == [-1, -1, 0, 0, -1, 1, -1, 0, 0]
    assert row["interaction_ids"] == ["i0", "i1", "i2"]
    assert row["reward"] == 1.0


def test_concat_breaks_where_a_turn_was_retokenized():
    t0 = _it("s1", 0, [1, 2], [3, 4])
    t1 = _it("s1", 1, [1, 2, 8, 9], [5], parent="i0", inherited=0, reward=1.0)  # hf: drifted
    rows = list(concat_rows(_session(), [t0, t1], 1.0))
    assert [r["interaction_ids"] for r in rows] == [["i0"], ["i1"]]
    assert [r["reward"] for r in rows] == [1.0, 1.0]


def test_continue_tokens_keeps_parent_ids_exactly():
    vocab = {"<a>": 1, "hi": 2, "\n": 3, "<u>": 4, "yo": 5}
    inv = {v: k for k, v in vocab.items()}

    def encode(text):
        out, i = [], 0
        while i < len(text):
            for tok in sorted(vocab, key=len, reverse=True):
                if text.startswith(tok, i):
                    out.append(vocab[tok])
                    i += len(tok)
                    break
            else:
                raise AssertionError(text[i:])
        return out

    def decode(ids):
        return "".join(inv[i] for i in ids)

    parent = [1, 2, 2]  # the model produced "hi" "hi" (a re-tokenizer might merge them)
    assert continue_tokens(parent, "<a>hihi\n<u>yo\n", decode, encode) == [1, 2, 2, 3, 4, 5, 3]
    assert continue_tokens(parent, "<a>changed history", decode, encode) is None


@pytest.fixture
def book(tmp_path):
    b = SessionBook(Store(tmp_path / "r.db"), ttl=60, reward_finish_timeout=0.0, max_live=4)
    return b


def _start(book, n=1, group="g1"):
    creds = []
    for _ in range(n):
        sid = new_id("sess")
        creds.append((sid, mint_key(sid)))
    book.start(group, "task", "m", creds)
    return creds


async def test_session_key_acts_only_on_its_session(book):
    (s1, k1), (s2, _) = _start(book, 2)
    assert session_of(k1) == s1
    assert book.authorize(s1, k1, for_turn=True).session_id == s1
    with pytest.raises(ServiceError) as info:
        book.authorize(s2, k1, for_turn=True)
    assert info.value.http_status == 401
    with pytest.raises(ServiceError) as info:
        book.authorize("sess-nope", k1, for_turn=True)
    assert info.value.http_status == 404


async def test_reward_closes_turns_unless_finish_timeout(book):
    [(sid, key)] = _start(book)
    s = book.authorize(sid, key, for_turn=True)
    with pytest.raises(ServiceError, match="no interaction"):
        book.set_reward(s, "", 1.0)
    it = await book.record(_new(sid, 0, [1], [2]))
    assert book.set_reward(s, "", 1.0) == it.interaction_id
    with pytest.raises(ServiceError) as info:
        book.authorize(sid, key, for_turn=True)
    assert info.value.code == "session_finished"
    book.reward_finish_timeout = 30.0
    assert book.authorize(sid, key, for_turn=True)
    for bad in [float("nan"), "1", True]:
        with pytest.raises(ServiceError) as info:
            book.set_reward(s, "", bad)
        assert info.value.http_status == 400
    with pytest.raises(ServiceError) as info:
        book.set_reward(s, "int-unknown", 1.0)
    assert info.value.http_status == 404


async def test_live_state_is_bounded_and_reloads(book):
    creds = _start(book, 10)
    for sid, key in creds:
        s = book.authorize(sid, key, for_turn=True)
        msgs = [{"role": "user", "content": "q"}]
        book.begin_turn(s, msgs)
        await book.record(_new(sid, 0, [1], [2], msgs=msgs))
    assert book.live_count <= 4
    sid, key = creds[0]
    s = book.authorize(sid, key, for_turn=True)
    turn = book.begin_turn(
        s,
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a0"},
            {"role": "user", "content": "r"},
        ],
    )
    assert turn.parent is not None and turn.covered == 2
    it = await book.record(_new(sid, 0, [1], [2]))
    assert it.seq == 1, "turn numbers continue after the session was evicted and reloaded"


async def test_a_known_sessions_turn_begins_from_memory_as_from_sqlite(book):
    """`begin_known` (the event loop's path for a small turn) gives what authorize +
    begin_turn give, reads no SQLite, and gives up (None) wherever they would read it."""
    (sid, key), (other, okey) = _start(book, 2)
    msgs = [{"role": "user", "content": "q"}]
    assert book.begin_known(sid, key, msgs) is None  # never read: not known
    s = book.authorize(sid, key, for_turn=True)
    book.begin_turn(s, msgs)
    await book.record(_new(sid, 0, [1], [2], msgs=msgs))
    reads = []
    session, interaction = book.store.session, book.store.interaction
    book.store.session = lambda *a: reads.append(a) or session(*a)
    book.store.interaction = lambda *a: reads.append(a) or interaction(*a)
    nxt = [*msgs, {"role": "assistant", "content": "a0"}, {"role": "user", "content": "r"}]
    turn = book.begin_known(sid, key, [dict(m) for m in nxt])
    assert turn is not None and reads == []
    again = book.begin_turn(book.authorize(sid, key, for_turn=True), [dict(m) for m in nxt])
    assert (turn.parent, turn.covered, turn.messages_hash) == (
        again.parent,
        again.covered,
        again.messages_hash,
    )
    reads.clear()
    with pytest.raises(ServiceError) as info:
        book.begin_known(sid, okey, msgs)  # the wrong key: refused from memory too
    assert info.value.http_status == 401
    # A parent that is not cached would be read from SQLite: the thread's job.
    book.turns.drop([sid])
    assert book.begin_known(sid, key, nxt) is None and reads == []
    # Every write to the session's row is seen: a reward closes it, an end ends it.
    assert book.begin_known(sid, key, msgs) is not None
    book.set_reward(s, "", 1.0)
    assert book.begin_known(sid, key, msgs) is None
    with pytest.raises(ServiceError) as info:
        book.authorize(sid, key, for_turn=True)
    assert info.value.code == "session_finished"
    book.authorize(other, okey, for_turn=True)
    assert book.begin_known(other, okey, None) is not None
    book.end([other])
    assert book.begin_known(other, okey, None) is None
    # ... and nothing runs here while another method holds the book.
    with book._lock:
        assert book.try_now(book.begin_known, other, okey, None) is None


async def test_small_commits_run_inline_checkpoint_on_the_thread_and_pause_when_slow(tmp_path):
    """A live session's commit runs on the caller's thread when the book is free; SQLite
    checkpoints only on the recording thread; a slow inline write sends writes to the
    thread for a while."""
    from concurrent.futures import ThreadPoolExecutor

    from areal_proxy.recording import sessions as sessions_mod
    from areal_proxy.recording import store as store_mod

    with ThreadPoolExecutor(1) as ex:
        book = SessionBook(Store(tmp_path / "r.db"), executor=ex)
        [(sid, key)] = _start(book)
        book.begin_turn(book.authorize(sid, key, for_turn=True), [{"role": "user", "content": "q"}])
        where = []
        record = book.record_now

        def spy(it):
            where.append(sessions_mod.threading.current_thread().name)
            return record(it)

        here = sessions_mod.threading.current_thread().name
        assert book.try_write_now(sid, spy, _new(sid, 0, [1], [2])).seq == 0
        assert book.try_write_now("sess-not-live", spy, _new(sid, 0, [1], [2])) is None
        with book._lock:
            assert book.try_write_now(sid, spy, _new(sid, 0, [1], [2])) is None
        assert where == [here]
        # Checkpoints: never at an inline commit, on the thread once due.
        checkpoints = []
        checkpoint = book.store.checkpoint
        book.store.checkpoint = lambda: (
            checkpoints.append(sessions_mod.threading.current_thread().name) or checkpoint()
        )
        book.store._wal_pages = store_mod._CHECKPOINT_PAGES
        assert book.try_write_now(sid, spy, _new(sid, 0, [1], [2])) is not None
        await book.call(lambda: None)  # after the thread's queued checkpoint
        assert checkpoints and here not in checkpoints and not book.store.checkpoint_due
        # A slow inline write: the next ones go to the thread.
        slow = sessions_mod._SLOW_WRITE_S
        assert book.try_write_now(sid, lambda: time.sleep(slow * 2) or 1) == 1
        assert book.try_write_now(sid, spy, _new(sid, 0, [1], [2])) is None
        assert [it.seq for it in book.store.interactions(sid)] == [0, 1]


async def test_export_errors_and_repeatability(book):
    creds = _start(book, 2, group="grp")
    for sid, _ in creds:
        await book.record(_new(sid, 0, [1], [2], reward=1.0))
    sessions = book.resolve_export([], "grp")
    first = list(book.export_rows(sessions, "individual", 1.0))
    assert first == list(book.export_rows(sessions, "individual", 1.0))
    assert len(first) == 2
    with pytest.raises(ServiceError) as info:
        book.resolve_export([], "nope")
    assert info.value.http_status == 404
    with pytest.raises(ServiceError):
        book.export_rows(sessions, "weird", 1.0)
    with pytest.raises(ServiceError):
        book.export_rows(sessions, "concat", 2.0)
    book.remove(sessions)
    with pytest.raises(ServiceError) as info:
        book.resolve_export([], "grp")
    assert info.value.http_status == 404


async def test_idle_sessions_expire(book):
    [(sid, key)] = _start(book)
    assert book.expire(time.time() + 30) == []
    assert book.expire(time.time() + 120) == [sid]
    with pytest.raises(ServiceError) as info:
        book.authorize(sid, key, for_turn=True)
    assert info.value.code == "session_ended"


async def test_a_closed_session_takes_rewards_only_for_unrewarded_interactions(book):
    # The choices of one request (n > 1) are rewarded one by one after the first closed it.
    [(sid, key)] = _start(book)
    s = book.authorize(sid, key, for_turn=True)
    a = await book.record(_new(sid, 0, [1], [2]))
    b = await book.record(_new(sid, 1, [1], [3]))
    book.set_reward(s, a.interaction_id, 1.0)

    def fresh():  # as each RPC reads it
        return book.authorize(sid, key, for_turn=False)

    assert book.set_reward(fresh(), b.interaction_id, 0.5) == b.interaction_id
    for again in (a.interaction_id, ""):  # a change, or "the last turn" again: refused
        with pytest.raises(ServiceError) as info:
            book.set_reward(fresh(), again, 9.0)
        assert info.value.code == "session_finished"
    with pytest.raises(ServiceError) as info:
        book.set_reward(fresh(), "int-unknown", 1.0)
    assert info.value.http_status == 404
    assert [t.reward for t in book.store.interactions(sid)] == [1.0, 0.5]


async def test_a_replica_that_lost_its_data_says_so_for_unknown_sessions(tmp_path):
    """Placed again on another node without a shared directory: an export of a session it
    recorded before is an error naming the loss, never an empty (short) answer."""
    why = "replica m-data-proxy-1 was placed again after node 198.18.0.12 was lost"
    book = SessionBook(Store(tmp_path / "fresh.db"), lost_data=why)
    for call in (
        lambda: book.resolve_export(["sess-before"], ""),
        lambda: book.resolve_export([], "group-before"),
        lambda: book.authorize("sess-before", "areal-sk-x.y", for_turn=False),
    ):
        with pytest.raises(ServiceError) as info:
            call()
        assert info.value.code == "replica_data_lost" and why in info.value.message
    # A replica that lost nothing keeps the plain answers.
    plain = SessionBook(Store(tmp_path / "plain.db"))
    with pytest.raises(ServiceError) as info:
        plain.resolve_export(["sess-before"], "")
    assert info.value.code == "session_not_found"
