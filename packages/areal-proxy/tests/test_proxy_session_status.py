"""GetSession: a session's status (turns, and how their chat prompts were built) through the
real ProxyServer (gRPC on loopback) and a fake engine; who may read it."""

from __future__ import annotations

from typing import Any

import grpc
import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, error_detail, start
from test_proxy_sessions import ADMIN, _group, _key_env

from areal_proto.proxy.v1 import proxy_pb2


async def _status(h, sid: str, env=ADMIN) -> dict[str, Any]:
    out = await h.stub.GetSession(proxy_pb2.GetSessionRequest(session_id=sid, envelope=env))
    return orjson.loads(out.status)


async def _turn(h, sid: str, key: str, msgs: list[dict[str, Any]]) -> str:
    h.engine._prompt_len = None  # each turn is a new request to the fake, not a resume
    r = await h.chat({"messages": msgs, "max_tokens": 4}, api_key=key, session_id=sid)
    return r["choices"][0]["message"]["content"]


async def test_status_counts_turns_by_prompt_path_and_fallbacks_by_reason():
    h = await start(FakeEngineClient([7, 8, EOS]))
    try:
        (sid, key), (other_sid, other_key) = await _group(h, 2)
        fresh = await _status(h, sid)
        assert fresh["session_id"] == sid and fresh["group_id"] == "g1"
        assert fresh["task_id"] == "task-1" and fresh["model"] == "tiny-parrot"
        assert fresh["interactions"] == 0 and fresh["ended"] is False
        assert fresh["prompt"] == {
            "incremental": 0,
            "full": 0,
            "fallbacks": {},
            "cached": False,
            "last_prompt_tokens": None,
        }
        # Three turns, each the whole conversation so far: its answer echoed, a new question.
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "q 0"},
        ]
        for turn in range(3):
            answer = await _turn(h, sid, key, msgs)
            msgs = [
                *msgs,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"question number {turn + 1}"},
            ]
        st = await _status(h, sid, _key_env(sid, key))
        assert st["interactions"] == 3 and st["ended"] is False
        prompt = st["prompt"]
        assert (prompt["incremental"], prompt["full"], prompt["fallbacks"]) == (2, 1, {})
        assert prompt["cached"] is True
        assert prompt["last_prompt_tokens"] == len(h.records[-1].prompt_ids)
        assert st["last_active_at"] >= st["created_at"] > 0
        # The first user message edited: no recorded turn is extended, a fallback with its reason.
        edited = [msgs[0], {"role": "user", "content": "q 0, edited"}, *msgs[2:]]
        await _turn(h, sid, key, edited)
        st = await _status(h, sid)  # the admin key reads any session
        assert st["interactions"] == 4
        prompt = st["prompt"]
        assert (prompt["incremental"], prompt["full"]) == (2, 2)
        assert prompt["fallbacks"] == {"history_edited": 1}
        # Another session's key: 403; a wrong key for the session: 401; unknown id: 404.
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _status(h, sid, _key_env(other_sid, other_key))
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_detail(ei.value).code == "forbidden_session"
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _status(h, sid, _key_env(sid, other_key))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_detail(ei.value).code == "invalid_session_key"
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _status(h, "sess-unknown")
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        assert error_detail(ei.value).code == "session_not_found"
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await _status(h, "")
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The other session is untouched by this one's turns.
        assert (await _status(h, other_sid, _key_env(other_sid, other_key)))["interactions"] == 0
    finally:
        await h.close()


async def test_an_ended_session_stays_readable_with_its_own_key():
    h = await start(FakeEngineClient([7, EOS]))
    try:
        [(sid, key)] = await _group(h)
        await _turn(h, sid, key, [{"role": "user", "content": "q"}])
        await h.stub.EndSessions(
            proxy_pb2.EndSessionsRequest(session_ids=[sid], envelope=_key_env(sid, key))
        )
        # Acting on it is refused (409) ...
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await h.stub.SetReward(
                proxy_pb2.SetRewardRequest(session_id=sid, reward=1.0, envelope=_key_env(sid, key))
            )
        assert error_detail(ei.value).code == "session_ended"
        # ... reading it is not.
        for env in (_key_env(sid, key), ADMIN):
            st = await _status(h, sid, env)
            assert st["ended"] is True and st["interactions"] == 1
            assert st["prompt"]["full"] == 1
    finally:
        await h.close()
