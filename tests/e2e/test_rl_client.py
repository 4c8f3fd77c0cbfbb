"""The typed Python client (areal_client) against a real stack and engine."""

from __future__ import annotations

import pytest
from stack import ADMIN_KEY, start_stack
from testpaths import PARROT

from areal_client import (
    ArealClient,
    AsyncArealClient,
    AuthenticationError,
    NotFoundError,
    PermissionDeniedError,
    Session,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("client"), sglang_engine.url, PARROT, n_proxies=1)
    yield s
    s.stop()


@pytest.fixture
def areal(stack):
    with ArealClient(stack.gateway_url, ADMIN_KEY) as client:
        yield client


def test_group_chat_reward_export(areal):
    assert "tiny-parrot" in areal.served_models()
    group = areal.start_group(task_id="client-test", group_size=2)
    assert group.model == "tiny-parrot" and len(group.sessions) == 2
    ids = {}
    for i, s in enumerate(group.sessions):
        r = s.openai(max_retries=0, http_client=areal.http_client).chat.completions.create(
            model=group.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        ids[s.session_id] = r.id
        reward = areal.set_reward(s, reward=float(i))
        assert (reward.session_id, reward.interaction_id, reward.reward) == (
            s.session_id,
            r.id,
            float(i),
        )
    rows = areal.export(group_id=group.group_id)
    assert rows.count == 2
    assert {r.interaction_id: r.reward for r in rows} == {
        ids[s.session_id]: float(i) for i, s in enumerate(group.sessions)
    }
    for row in rows:
        assert row.task_id == "client-test" and row.group_id == group.group_id
        assert len(row.input_ids) == len(row.loss_mask) == len(row.logprobs) == len(row.versions)
        assert row.output_versions and min(row.output_versions) >= 0
    assert list(areal.iter_export(group_id=group.group_id)) == rows.rows
    # A session key exports its own session only.
    own = areal.export(session=group.sessions[0])
    assert [r.session_id for r in own] == [group.sessions[0].session_id]
    # A loop that stops early acknowledges nothing: every row is still there.
    for _ in areal.iter_export(group_id=group.group_id, remove_session=True):
        break
    assert areal.export(group_id=group.group_id).rows == rows.rows
    removed = areal.export(group_id=group.group_id, remove_session=True)
    assert removed.rows == rows.rows and removed.export_id
    with pytest.raises(NotFoundError) as info:
        areal.export(group_id=group.group_id)
    assert info.value.status == 404 and info.value.code and info.value.message
    # Acknowledged already (by export): again, nothing more to remove.
    assert areal.ack_export(removed.export_id).removed == []


def test_iter_export_read_whole_removes_the_sessions(areal):
    session = areal.start_session(task_id="client-iter")
    session.openai(max_retries=0, http_client=areal.http_client).chat.completions.create(
        model="tiny-parrot", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    rows = list(areal.iter_export(session_ids=[session.session_id], remove_session=True))
    assert [r.session_id for r in rows] == [session.session_id]
    with pytest.raises(NotFoundError):
        areal.export(session_ids=[session.session_id])


def test_session_status_from_the_proxy_that_holds_it(areal):
    """GET /rl/sessions/{id} through the real router and proxy: its own key or the admin key,
    ended too; another session's key is refused."""
    group = areal.start_group(task_id="client-status", group_size=2)
    s, other = group.sessions
    llm = s.openai(max_retries=0, http_client=areal.http_client)
    msgs = [{"role": "user", "content": "hi"}]
    for turn in range(2):
        r = llm.chat.completions.create(model=group.model, messages=msgs, max_tokens=2)
        answer = {"role": "assistant", "content": r.choices[0].message.content}
        msgs = [*msgs, answer, {"role": "user", "content": f"more {turn}"}]
    st = areal.session_status(s)
    assert (st.session_id, st.group_id, st.task_id, st.model) == (
        s.session_id,
        group.group_id,
        "client-status",
        group.model,
    )
    assert st.interactions == 2 and not st.ended and st.prompt.cached
    # The first turn is built whole; the second continues it unless it fell back (with why).
    assert st.prompt.incremental + st.prompt.full == 2 and st.prompt.full >= 1
    assert sum(st.prompt.fallbacks.values()) == st.prompt.full - 1
    assert areal.session_status(s.session_id) == st  # the admin key
    with pytest.raises(PermissionDeniedError) as info:
        areal.session_status(Session(s.session_id, other.api_key, group.group_id, s.base_url))
    assert info.value.code == "forbidden_session"
    assert areal.session_status(other).interactions == 0
    assert areal.end_session(s) == 1
    ended = areal.session_status(s)
    assert ended.ended and ended.interactions == 2 and not ended.prompt.cached
    with pytest.raises(NotFoundError) as info:
        areal.session_status("sess-0123456789abcdef01234567")
    assert info.value.code == "session_not_found"


def test_admin_listing_and_control_round_trip(areal):
    [model] = [m for m in areal.list_models() if m.name == "tiny-parrot"]
    assert model.kind == "internal" and len(model.workers) == 1
    [worker] = [w for w in areal.list_workers() if w.model == "tiny-parrot"]
    assert worker.proxy_id == model.workers[0].proxy_id and worker.health == "healthy"
    [w] = areal.pause().workers
    assert w.paused is True and w.proxy_id == worker.proxy_id
    [w] = areal.resume().workers
    assert w.paused is False
    assert areal.set_version(5).version == 5
    assert areal.update_weights(str(PARROT)).version == 6
    with pytest.raises(NotFoundError) as info:
        areal.update_weights(str(PARROT), worker="no-such-worker")
    assert info.value.status == 404 and info.value.code == "worker_not_found"


def test_wrong_admin_key_is_an_authentication_error(stack):
    with (
        ArealClient(stack.gateway_url, "not-the-key") as bad,
        pytest.raises(AuthenticationError) as info,
    ):
        bad.start_group(task_id="x")
    assert info.value.status == 401 and info.value.message


async def test_async_client_session_round_trip(stack):
    async with AsyncArealClient(stack.gateway_url, ADMIN_KEY) as areal:
        session = await areal.start_session(task_id="async-test")
        llm = session.async_openai(max_retries=0, http_client=areal.http_client)
        r = await llm.chat.completions.create(
            model="tiny-parrot", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert (await areal.set_reward(session, 0.5)).interaction_id == r.id
        streamed = [row async for row in areal.iter_export(session_ids=[session.session_id])]
        assert [(x.interaction_id, x.reward) for x in streamed] == [(r.id, 0.5)]
        assert await areal.end_session(session) == 1
        result = await areal.export(session_ids=[session.session_id], remove_session=True)
        assert result.rows == streamed
