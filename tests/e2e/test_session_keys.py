"""Forged session keys against the real router under `session_affinity` (real SGLang, CPU).

`session_affinity` pins a session id it does not know on its first `Route`, so before session
keys carried a MAC a forged key (`areal-sk-<made-up id>.<anything>`) left a pin in the
router's state per made-up id, with nothing to release it. Now the gateway refuses such a key
(401) before routing: the router's pin count does not move, whatever is forged.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from stack import ADMIN_KEY, start_stack, workers
from testpaths import PARROT

pytestmark = pytest.mark.engine

MODEL = "tiny-parrot"


@pytest.fixture(scope="module")
def affinity_stack(sglang_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("session-keys"),
        sglang_engine.url,
        PARROT,
        policy="session_affinity",
        n_proxies=1,
    )
    yield s
    s.stop()


def _pins(stack) -> int:
    return sum(int(w.get("sessions", 0)) for w in workers(stack))


def _as(stack, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=stack.gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def test_forged_keys_pin_nothing_under_session_affinity(affinity_stack):
    stack = affinity_stack
    with _as(stack, ADMIN_KEY) as c:
        r = c.post("/rl/start_session", json={"task_id": "t", "group_size": 1})
    assert r.status_code == 201, r.text
    [sess] = r.json()["sessions"]
    key = sess["session_api_key"]
    pins = _pins(stack)
    _, rand, mac = key.removeprefix("areal-sk-").split(".")
    forged = [
        f"areal-sk-sess-{i:024x}.{rand}.{'A' * 22}"
        for i in range(3)  # bad MAC, new ids
    ] + [
        f"areal-sk-sess-{9:024x}.{rand}",  # the MAC-less shape of keys minted before
        f"areal-sk-sess-{8:024x}.{rand}.{mac}",  # a real MAC, on another id
    ]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for k in forged:
        client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=k, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(**chat)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        with _as(stack, k) as c:
            for path, body in (
                ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
                ("/rl/set_reward", {"reward": 1.0}),
                ("/rl/end_session", {}),
                ("/rl/export_trajectories", {}),
            ):
                r = c.post(path, json=body)
                assert r.status_code == 401, (k, path, r.text)
    assert _pins(stack) == pins  # nothing pinned for any made-up id
    # The real key still works, and its session was pinned at start, not now.
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0)
    assert client.chat.completions.create(**chat).choices
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _pins(stack) == pins
