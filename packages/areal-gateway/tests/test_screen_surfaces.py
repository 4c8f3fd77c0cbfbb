"""The body screen on every surface that parses a client body, and its cost rule: a body is
parsed on the gateway's loop only while its estimated parse (bytes and structure:
areal_runtime.bodycost) is small, however it was reached (a session's gradual growth
included); a body with more structure than any request needs is refused (413
`body_too_complex`, in the endpoint's error shape) before the gateway or the proxy parses it."""

from __future__ import annotations

import uuid

import httpx
import orjson
import pytest
from conftest import ADMIN_KEY, Stack

from areal_gateway.anthropic.request import translate
from areal_gateway.openai import screen
from areal_gateway.prefix import prefix_hashes
from areal_runtime import bodycost

BIG = 8 * 1024 * 1024
PAD = "lorem ipsum " * 40_000  # ~480 kB of prose: over the screen's size threshold


@pytest.fixture(scope="module")
def gw(stack: Stack):
    stack.register("m-surf")
    return stack.start_gateway(max_body_bytes=BIG, session_key_secret="s" * 40)


@pytest.fixture
def screened(gw):
    """The frame kinds and sizes the gateway sent to its screen during a test."""
    real = gw.gateway.screen.call
    seen: list[tuple[bytes, int]] = []

    async def counting(kind: bytes, body: bytes) -> bytes:
        seen.append((kind, len(body)))
        return await real(kind, body)

    gw.gateway.screen.call = counting
    yield seen
    gw.gateway.screen.call = real


def _post(gw, path: str, doc: dict | bytes, key: str = ADMIN_KEY) -> tuple[str, httpx.Response]:
    rid = "req-" + uuid.uuid4().hex
    body = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    headers = {"x-request-id": rid, "content-type": "application/json"}
    headers["x-api-key" if path.startswith("/v1/messages") else "authorization"] = (
        key if path.startswith("/v1/messages") else f"Bearer {key}"
    )
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        return rid, c.post(path, content=body, headers=headers)


def _empties(n: int) -> list[dict]:
    return [{}] * n


def test_gradual_growth_of_an_expensive_field_is_screened_then_refused(
    stack: Stack, gw, screened
) -> None:
    """One session key grows a list of empty objects by ~250 KiB a turn (each turn within
    the long-session cheap path's allowance). Bytes alone would let every turn be parsed on
    the loop; by cost, the first turn over the loop's budget goes to the screen, and the one
    past the structure limit is refused, as is the flood of it that follows."""
    sid = "sess-" + uuid.uuid4().hex[:24]
    key = gw.gateway.auth.mint_session_key(sid)
    step = 250 * 1024 // 3  # `{},` is 3 bytes
    pad: list[dict] = []
    answers = []
    for _turn in range(4):
        doc = {
            "model": "m-surf",
            "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"pad": pad},
        }
        body = orjson.dumps(doc)
        before = len(screened)
        _, r = _post(gw, "/v1/chat/completions", body, key)
        answers.append((r.status_code, bodycost.parses_inline(body), len(screened) > before))
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["code"] == "body_too_complex" and err["type"] == "invalid_request_error"
            assert "objects and arrays" in err["message"], err
            break
        pad = pad + _empties(step)
    # Turn 1: small and cheap, parsed here. Turn 2 (~250 KiB more): over the loop's budget,
    # screened although it grew by less than the threshold. Turn 3: over the structure limit.
    assert answers[0] == (200, True, False)
    assert answers[1] == (200, False, True)
    assert answers[2] == (413, False, True)
    # The flood: the same body again and again is refused by the screen each time.
    for _ in range(3):
        before = len(screened)
        _, r = _post(gw, "/v1/chat/completions", body, key)
        assert r.status_code == 413 and len(screened) == before + 1


def test_a_long_sessions_growing_prose_still_takes_the_cheap_path(gw, screened) -> None:
    sid = "sess-" + uuid.uuid4().hex[:24]
    key = gw.gateway.auth.mint_session_key(sid)
    msgs = [{"role": "user", "content": PAD}]
    for turn in range(3):
        _, r = _post(gw, "/v1/chat/completions", {"model": "m-surf", "messages": msgs}, key)
        assert r.status_code == 200, r.text
        assert len(screened) == 1, f"turn {turn}: only the session's first huge body"
        msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "y"}]


def test_a_huge_messages_body_is_translated_by_the_screen(stack: Stack, gw, screened) -> None:
    doc = {
        "model": "m-surf",
        "max_tokens": 8,
        "system": "be brief",
        "stop_sequences": ["END"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": PAD}]}],
    }
    rid, r = _post(gw, "/v1/messages", doc)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    assert screened == [(screen.MESSAGES, len(orjson.dumps(doc)))]
    # The proxy got the chat body the gateway builds itself for a small one.
    assert stack.find(rid).body == orjson.dumps(translate(doc).chat)


def test_a_huge_bad_messages_body_gets_the_error_a_small_one_gets(gw, screened) -> None:
    bad = {"model": "m-surf", "messages": [{"role": "user", "content": "x"}]}  # no max_tokens
    _, small = _post(gw, "/v1/messages", bad)
    _, big = _post(gw, "/v1/messages", {**bad, "metadata": {"user_id": PAD}})
    assert small.status_code == 400
    assert (big.status_code, big.json()) == (small.status_code, small.json())
    assert [k for k, _ in screened] == [screen.MESSAGES]


def test_7mb_of_empty_text_blocks_on_messages_is_refused_in_anthropics_shape(
    stack: Stack, gw, screened
) -> None:
    blocks = [{"type": "text", "text": ""}] * 280_000
    doc = {"model": "m-surf", "max_tokens": 8, "messages": [{"role": "user", "content": blocks}]}
    seen = len(stack.all_received())
    _, r = _post(gw, "/v1/messages", doc)
    assert r.status_code == 413, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    assert "objects and arrays" in body["error"]["message"]
    assert [k for k, _ in screened] == [screen.MESSAGES]
    assert len(stack.all_received()) == seen, "nothing reached a proxy"


def test_many_small_responses_input_items_are_refused(stack: Stack, gw) -> None:
    items = [{"role": "user", "content": "a"}] * 240_000
    seen = len(stack.all_received())
    _, r = _post(gw, "/v1/responses", {"model": "m-surf", "input": items})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "body_too_complex"
    assert len(stack.all_received()) == seen
    # A huge body of prose is still answered.
    _, r = _post(gw, "/v1/responses", {"model": "m-surf", "input": PAD})
    assert r.status_code == 200, r.text


def test_control_and_rl_bodies_are_bounded_by_cost(gw) -> None:
    doc = {"task_id": "t", "group_size": 1, "metadata": {"pad": _empties(200_000)}}
    _, r = _post(gw, "/rl/start_session", doc)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "body_too_complex"


def test_the_screen_translates_messages_and_count_tokens_as_the_gateway_would() -> None:
    fn = screen.make()
    doc = {
        "model": "m",
        "max_tokens": 4,
        "stream": True,
        "messages": [{"role": "user", "content": PAD}],
        "web_search_options": None,
    }
    for kind, counting in ((screen.MESSAGES, False), (screen.COUNT_TOKENS, True)):
        want = translate(doc, counting=counting)
        found = screen.answer_of(fn(kind + orjson.dumps(doc)))
        assert found.chat_body == orjson.dumps(want.chat)
        assert found.prefix == prefix_hashes(want.chat)
        t = found.translated
        assert t is not None
        assert (t.model, t.stream, t.stop_sequences) == (want.model, want.stream, [])
        assert (t.left_out.items, t.system_at) == (want.left_out.items, want.system_at)


def test_the_cost_estimate_counts_structure() -> None:
    prose = orjson.dumps({"messages": [{"role": "user", "content": PAD}]})
    empties = orjson.dumps({"pad": _empties(len(prose) // 3)})
    assert abs(len(prose) - len(empties)) < 1024
    assert bodycost.cost_ns(empties) > 50 * bodycost.cost_ns(prose)
    assert bodycost.too_complex(prose) is None
    assert bodycost.too_complex(empties) is not None
    assert bodycost.parses_inline(b"{}" * 100)
