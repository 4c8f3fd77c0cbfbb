"""The typed Python client (areal_gateway.client) against a real stack and engine."""

from __future__ import annotations

import pytest
from stack import ADMIN_KEY, start_stack
from testpaths import PARROT

from areal_gateway.client import ArealClient, ArealError

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def areal(sglang_engine, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("client"), sglang_engine.url, PARROT, n_proxies=1)
    with ArealClient(s.gateway_url, ADMIN_KEY) as client:
        yield client
    s.stop()


def test_group_chat_reward_export(areal):
    assert "tiny-parrot" in areal.models()
    group = areal.start_group(task_id="client-test", group_size=2)
    assert group.model == "tiny-parrot" and len(group.sessions) == 2
    ids = {}
    for i, s in enumerate(group.sessions):
        r = s.openai(max_retries=0).chat.completions.create(
            model=group.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        ids[s.session_id] = r.id
        assert areal.set_reward(s, reward=float(i)) == r.id
    rows = areal.export(group_id=group.group_id)
    assert {r["interaction_id"]: r["reward"] for r in rows} == {
        ids[s.session_id]: float(i) for i, s in enumerate(group.sessions)
    }
    assert list(areal.iter_export(group_id=group.group_id)) == rows
    assert areal.export(group_id=group.group_id, remove_session=True) == rows
    with pytest.raises(ArealError) as info:
        areal.export(group_id=group.group_id)
    assert info.value.status == 404 and info.value.code


def test_control_round_trip(areal):
    [w] = areal.pause()
    assert w.paused is True
    [w] = areal.resume()
    assert w.paused is False
    [w] = areal.set_version(5)
    assert w.version == 5
    assert areal.update_weights(str(PARROT)) == 6
    with pytest.raises(ArealError) as info:
        areal.update_weights(str(PARROT), worker="no-such-worker")
    assert info.value.status == 404
