"""RL recording through the real ProxyServer (gRPC on loopback) and a fake engine."""

from __future__ import annotations

import itertools

import grpc
import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, start

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2
from areal_runtime.session_keys import mint_key, new_id

ADMIN = envelope_pb2.Envelope(api_key="admin", is_admin=True)


async def _group(h, n=1, group="g1", task="task-1"):
    creds = []
    for _ in range(n):
        sid = new_id("sess")
        creds.append(proxy_pb2.SessionCredentials(session_id=sid, session_api_key=mint_key(sid)))
    await h.stub.StartSessions(
        proxy_pb2.StartSessionsRequest(task_id=task, group_id=group, sessions=creds)
    )
    return [(c.session_id, c.session_api_key) for c in creds]


async def _export(
    h,
    *,
    group_id="",
    session_ids=(),
    style="individual",
    discount=1.0,
    remove=False,
    env=ADMIN,
    export_id="",
):
    rows = []
    async for chunk in h.stub.ExportTrajectories(
        proxy_pb2.ExportTrajectoriesRequest(
            group_id=group_id,
            session_ids=list(session_ids),
            style=style,
            discount=discount,
            remove_session=remove,
            envelope=env,
            export_id=export_id or ("exp-test" if remove else ""),
        )
    ):
        rows.extend(orjson.loads(line) for line in chunk.jsonl.splitlines())
    return rows


def _key_env(sid, key):
    return envelope_pb2.Envelope(api_key=key, session_id=sid)


async def test_session_chat_is_recorded_and_exported_exactly():
    h = await start(FakeEngineClient([7, 8, EOS]))
    try:
        [(sid, key)] = await _group(h)
        msgs = [{"role": "user", "content": "hi"}]
        r = await h.chat({"messages": msgs, "max_tokens": 10}, api_key=key, session_id=sid)
        [rec] = h.records
        [row] = await _export(h, group_id="g1")
        assert row["interaction_id"] == r["id"]
        assert row["input_ids"] == rec.prompt_ids + rec.token_ids
        assert rec.token_ids[-1] == EOS, "the stop token is part of the trainable output"
        p = len(rec.prompt_ids)
        assert row["loss_mask"] == [0] * p + [1] * len(rec.token_ids)
        assert row["logprobs"] == [0.0] * p + rec.logprobs
        assert row["versions"] == [-1] * p + [0] * len(rec.token_ids)
        assert (row["session_id"], row["group_id"], row["task_id"]) == (sid, "g1", "task-1")
        assert row["reward"] == 0.0
    finally:
        await h.close()


async def test_admin_chat_records_nothing():
    h = await start(FakeEngineClient([7, EOS]))
    try:
        await _group(h)
        await h.chat(
            {"messages": [{"role": "user", "content": "x"}]}, api_key="admin", is_admin=True
        )
        assert await _export(h, group_id="g1") == []
    finally:
        await h.close()


async def test_reward_defaults_to_last_turn_and_closes_the_session():
    h = await start(FakeEngineClient([7, EOS]))
    try:
        [(sid, key)] = await _group(h)
        msgs = [{"role": "user", "content": "q"}]
        await h.chat({"messages": msgs}, api_key=key, session_id=sid)
        r2 = await h.chat({"messages": msgs}, api_key=key, session_id=sid)
        out = await h.stub.SetReward(
            proxy_pb2.SetRewardRequest(session_id=sid, reward=1.5, envelope=_key_env(sid, key))
        )
        assert out.interaction_id == r2["id"]
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.chat({"messages": msgs}, api_key=key, session_id=sid)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        rows = await _export(h, session_ids=[sid], discount=0.5)
        assert [r["reward"] for r in rows] == [0.75, 1.5]
    finally:
        await h.close()


async def test_finish_timeout_keeps_the_trajectory_open():
    h = await start(FakeEngineClient([7, EOS]), set_reward_finish_timeout=30.0)
    try:
        [(sid, key)] = await _group(h)
        msgs = [{"role": "user", "content": "q"}]
        await h.chat({"messages": msgs}, api_key=key, session_id=sid)
        await h.stub.SetReward(
            proxy_pb2.SetRewardRequest(session_id=sid, reward=1.0, envelope=_key_env(sid, key))
        )
        await h.chat({"messages": msgs}, api_key=key, session_id=sid)
        await h.stub.SetReward(
            proxy_pb2.SetRewardRequest(session_id=sid, reward=2.0, envelope=_key_env(sid, key))
        )
        assert [r["reward"] for r in await _export(h, session_ids=[sid], discount=0.0)] == [
            1.0,
            2.0,
        ]
    finally:
        await h.close()


async def test_session_keys_are_scoped_and_errors_are_clear():
    h = await start(FakeEngineClient([7, EOS]))
    try:
        (s1, k1), (s2, k2) = await _group(h, 2)
        msgs = [{"role": "user", "content": "q"}]
        await h.chat({"messages": msgs}, api_key=k2, session_id=s2)
        cases = [
            # key of s1 claiming s2 (the gateway routes by the key's own session; a forged one fails)
            (
                h.chat({"messages": msgs}, api_key=k1, session_id=s2),
                grpc.StatusCode.UNAUTHENTICATED,
            ),
            (
                h.stub.SetReward(
                    proxy_pb2.SetRewardRequest(session_id=s2, reward=1, envelope=_key_env(s1, k1))
                ),
                grpc.StatusCode.PERMISSION_DENIED,
            ),
            (
                h.stub.SetReward(
                    proxy_pb2.SetRewardRequest(session_id=s1, reward=1, envelope=_key_env(s1, k1))
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            (
                h.stub.SetReward(
                    proxy_pb2.SetRewardRequest(
                        session_id=s2, interaction_id="int-x", reward=1, envelope=_key_env(s2, k2)
                    )
                ),
                grpc.StatusCode.NOT_FOUND,
            ),
            (
                h.chat({"messages": msgs}, api_key=k1, session_id="sess-unknown"),
                grpc.StatusCode.NOT_FOUND,
            ),
            (_export(h, group_id="no-such-group"), grpc.StatusCode.NOT_FOUND),
            (_export(h, session_ids=[s2], env=_key_env(s1, k1)), grpc.StatusCode.PERMISSION_DENIED),
            (_export(h, group_id="g1", style="zigzag"), grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for coro, code in cases:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await coro
            assert ei.value.code() == code, ei.value.details()
        assert len(await _export(h, session_ids=[s2], env=_key_env(s2, k2))) == 1
    finally:
        await h.close()


async def test_repeated_export_is_identical_and_removal_only_when_asked():
    h = await start(FakeEngineClient([7, EOS]))
    try:
        creds = await _group(h, 3)
        for sid, key in creds:
            await h.chat(
                {"messages": [{"role": "user", "content": sid}]}, api_key=key, session_id=sid
            )
        first = await _export(h, group_id="g1")
        assert len(first) == 3
        assert await _export(h, group_id="g1") == first
        assert await _export(h, group_id="g1", remove=True, export_id="exp-1") == first
        # Handed to gRPC is not received by the client: nothing is gone before the ack.
        assert await _export(h, group_id="g1") == first
        out = await _ack(h, "exp-1")
        assert sorted(out.removed_session_ids) == sorted(sid for sid, _ in creds)
        assert list(out.emptied_group_ids) == ["g1"] and not out.kept_session_ids
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _export(h, group_id="g1")
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        # Idempotent: the same ack again (a retry after a lost answer) removes nothing.
        assert not (await _ack(h, "exp-1")).removed_session_ids
    finally:
        await h.close()


async def _ack(h, export_id, env=ADMIN):
    return await h.stub.AckExport(proxy_pb2.AckExportRequest(export_id=export_id, envelope=env))


async def test_removal_needs_an_export_id():
    h = await start(FakeEngineClient([7, EOS]))
    try:
        await _group(h)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in h.stub.ExportTrajectories(
                proxy_pb2.ExportTrajectoriesRequest(
                    group_id="g1", remove_session=True, envelope=ADMIN
                )
            ):
                pass
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Still there (a removed group would be NOT_FOUND), with no row yet.
        assert await _export(h, group_id="g1") == []
    finally:
        await h.close()


async def test_an_unacknowledged_export_loses_nothing_and_a_newer_claim_wins():
    h = await start(FakeEngineClient([7, EOS]), set_reward_finish_timeout=30.0)
    try:
        (s1, k1), (s2, k2) = await _group(h, 2)
        for sid, key in ((s1, k1), (s2, k2)):
            await h.chat(
                {"messages": [{"role": "user", "content": sid}]}, api_key=key, session_id=sid
            )
        first = await _export(h, group_id="g1", remove=True, export_id="exp-a")
        # A client that never acknowledges (it died mid-stream): every row is exportable again,
        # and a new export with removal claims them under its own id.
        assert await _export(h, group_id="g1", remove=True, export_id="exp-b") == first
        # The older export's late ack removes nothing the newer one may not have delivered.
        assert not (await _ack(h, "exp-a")).removed_session_ids
        assert await _export(h, group_id="g1") == first
        # A turn and a reward after the export was read: that session is kept on ack (its new
        # rows were never sent); the unchanged one goes, and the group is not empty yet.
        await h.chat({"messages": [{"role": "user", "content": "more"}]}, api_key=k1, session_id=s1)
        await h.stub.SetReward(
            proxy_pb2.SetRewardRequest(session_id=s2, reward=1.0, envelope=_key_env(s2, k2))
        )
        out = await _ack(h, "exp-b")
        assert not out.removed_session_ids and sorted(out.kept_session_ids) == sorted([s1, s2])
        rows = await _export(h, group_id="g1", remove=True, export_id="exp-c")
        assert len(rows) == 3 and {r["reward"] for r in rows if r["session_id"] == s2} == {1.0}
        # A session key acknowledges only its own session.
        out = await _ack(h, "exp-c", env=_key_env(s1, k1))
        assert list(out.removed_session_ids) == [s1] and not out.emptied_group_ids
        assert not (await _ack(h, "exp-c", env=_key_env(s2, k1))).removed_session_ids
        assert [r["session_id"] for r in await _export(h, group_id="g1")] == [s2]
        out = await _ack(h, "exp-c")
        assert list(out.removed_session_ids) == [s2] and list(out.emptied_group_ids) == ["g1"]
    finally:
        await h.close()


async def test_concat_turns_continue_the_exact_token_stream():
    h = await start(FakeEngineClient([7, 8, EOS]), chat_template_type="concat")
    try:
        [(sid, key)] = await _group(h)
        msgs = [{"role": "user", "content": "one"}]
        for turn in range(3):
            r = await h.chat({"messages": msgs}, api_key=key, session_id=sid)
            msgs = [
                *msgs,
                {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"next {turn}"},
            ]
        recs = h.records
        for prev, cur in itertools.pairwise(recs):
            assert (
                cur.prompt_ids[: len(prev.prompt_ids) + len(prev.token_ids)]
                == prev.prompt_ids + prev.token_ids
            )
        [row] = await _export(h, session_ids=[sid], style="concat")
        last = recs[-1]
        assert row["input_ids"] == last.prompt_ids + last.token_ids
        assert sum(row["loss_mask"]) == sum(len(r.token_ids) for r in recs)
        assert len(row["interaction_ids"]) == 3
        # Each turn's output span carries that turn's tokens; template text between is masked out.
        for r in recs:
            start_ = len(r.prompt_ids)
            assert row["input_ids"][start_ : start_ + len(r.token_ids)] == r.token_ids
            assert row["loss_mask"][start_ : start_ + len(r.token_ids)] == [1] * len(r.token_ids)
        assert len(await _export(h, session_ids=[sid], style="individual")) == 3
    finally:
        await h.close()


async def test_stats_count_live_sessions():
    h = await start(FakeEngineClient([7, EOS]))
    try:
        creds = await _group(h, 4)
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert stats.sessions == 4
        await h.stub.EndSessions(
            proxy_pb2.EndSessionsRequest(session_ids=[creds[0][0]], envelope=ADMIN)
        )
        assert (await h.status.GetStats(proxy_pb2.GetStatsRequest())).sessions == 3
    finally:
        await h.close()


async def test_streamed_tool_call_is_recorded_with_the_ids_the_client_got():
    # The recorded assistant message is what the client echoes back on its next turn: its
    # tool call ids must be the ones streamed, not fresh ones from parsing the text again.
    engine = FakeEngineClient([])
    h = await start(engine, tool_call_parser="hermes")
    text = (
        'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    engine.sequence = [*h.tok.encode(text), EOS]
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in ("get_weather", "get_time")
    ]
    try:
        [(sid, key)] = await _group(h)
        msgs = [{"role": "user", "content": "weather?"}]
        chunks = await h.chat_stream(
            {"messages": msgs, "tools": tools, "stream": True}, api_key=key, session_id=sid
        )
        streamed = [
            tc["id"]
            for c in chunks
            if c["choices"]
            for tc in c["choices"][0]["delta"].get("tool_calls", [])
            if "id" in tc
        ]
        assert len(streamed) == 2
        [row] = await _export(h, group_id="g1")
        recorded = h.server.book.store.interaction(row["interaction_id"])
        assert recorded is not None and isinstance(recorded.response, dict)
        assert [c["id"] for c in recorded.response["tool_calls"]] == streamed
        assert recorded.response["content"] == "Checking."
        assert [c["function"]["name"] for c in recorded.response["tool_calls"]] == [
            "get_weather",
            "get_time",
        ]
    finally:
        await h.close()
