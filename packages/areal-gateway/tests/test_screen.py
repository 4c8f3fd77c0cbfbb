"""Huge generation bodies are parsed in the gateway's screen process (openai/screen.py):
the answers, the errors and the bytes the proxy gets are what they are without it."""

from __future__ import annotations

import os
import signal
import uuid

import httpx
import orjson
import pytest
from conftest import ADMIN_KEY, Stack, wait_until

from areal_gateway.openai import screen
from areal_gateway.prefix import prefix_hashes

BIG = 2 * 1024 * 1024
PAD = "lorem ipsum " * 40_000  # ~480 kB: over the screen's threshold


@pytest.fixture(scope="module")
def big_gateway(stack: Stack):
    stack.register("m-screen")
    gw = stack.start_gateway(max_body_bytes=BIG)
    yield gw


def _post(url: str, body: bytes, path: str = "/v1/chat/completions", **headers: str):
    rid = "req-" + uuid.uuid4().hex
    with httpx.Client(base_url=url, timeout=30) as c:
        r = c.post(
            path,
            content=body,
            headers={"Authorization": f"Bearer {ADMIN_KEY}", "x-request-id": rid, **headers},
        )
    return rid, r


def test_a_huge_chat_is_read_by_the_screen_and_reaches_the_proxy_byte_for_byte(
    stack: Stack, big_gateway
) -> None:
    body = orjson.dumps(
        {"model": "m-screen", "messages": [{"role": "user", "content": PAD}], "stream": False}
    )
    assert len(body) > screen.SCREEN_MIN_BODY
    rid, r = _post(big_gateway.url, body)
    assert r.status_code == 200, r.text
    got = stack.find(rid)
    assert got.method == "ChatCompletion" and got.body == body
    child = big_gateway.gateway.screen.pid
    assert child is not None and child != os.getpid()
    # Streamed, and a completion: the flag and the method come from the screen's reading.
    body = orjson.dumps({"model": "m-screen", "prompt": PAD, "stream": True})
    with httpx.Client(base_url=big_gateway.url, timeout=30) as c:
        rid = "req-" + uuid.uuid4().hex
        with c.stream(
            "POST",
            "/v1/completions",
            content=body,
            headers={"Authorization": f"Bearer {ADMIN_KEY}", "x-request-id": rid},
        ) as s:
            assert s.status_code == 200
            assert b"data: [DONE]" in s.read()
    got = stack.find(rid)
    assert got.method == "CompletionStream" and got.envelope.stream is True


@pytest.mark.parametrize(
    "doc",
    [
        {"messages": [{"role": "user", "content": "x"}]},  # no model
        {"model": "m-screen", "messages": "x"},
        {"model": "m-screen", "messages": []},
        {"model": "m-screen", "messages": [{"role": "user"}], "stream": "yes"},
        {"model": 5, "messages": [{"role": "user"}]},
        ["not", "an", "object"],
    ],
)
def test_a_huge_bad_body_gets_the_error_a_small_one_gets(big_gateway, doc) -> None:
    small = orjson.dumps(doc)
    big = orjson.dumps({**doc, "pad": PAD}) if isinstance(doc, dict) else orjson.dumps([*doc, PAD])
    assert len(big) > screen.SCREEN_MIN_BODY
    _, want = _post(big_gateway.url, small)
    _, got = _post(big_gateway.url, big)
    assert want.status_code == 400 and got.status_code == 400
    assert got.json() == want.json()


def test_invalid_json_and_a_dead_screen(big_gateway) -> None:
    broken = b'{"model": "m-screen", "messages": [' + b" " * 400_000 + b"}"
    _, got = _post(big_gateway.url, broken)
    assert got.status_code == 400 and got.json()["error"]["code"] == "invalid_json"
    body = orjson.dumps({"model": "m-screen", "messages": [{"role": "user", "content": PAD}]})
    assert _post(big_gateway.url, body)[1].status_code == 200
    first = big_gateway.gateway.screen.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: not os.path.exists(f"/proc/{first}/cmdline") or _zombie(first))
    # The gateway parses the body itself, and the next huge one starts a new screen.
    assert _post(big_gateway.url, body)[1].status_code == 200
    assert _post(big_gateway.url, body)[1].status_code == 200
    assert big_gateway.gateway.screen.pid not in (None, first)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_screen_reads_what_the_gateway_would() -> None:
    fn = screen.make()
    doc = {
        "model": "m",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": PAD}],
        "stream": True,
    }
    found = screen.answer_of(fn(screen.CHAT + orjson.dumps(doc)))
    assert (found.model, found.stream, found.prefix) == ("m", True, prefix_hashes(doc))
    assert found.chat_body is None and found.translated is None
    ids = {"model": "m", "prompt": list(range(1000))}
    found = screen.answer_of(fn(screen.COMPLETION + orjson.dumps(ids)))
    assert (found.model, found.stream, found.prefix) == ("m", False, prefix_hashes(ids))


def test_the_screen_works_on_the_gateways_event_loop() -> None:
    # The binary runs on uvloop (server.loop_factory), whose pipe transports differ.
    import asyncio

    from areal_gateway.server import loop_factory
    from areal_runtime.offload import Offload, OffloadFailed

    async def go() -> screen.Screened:
        off = Offload("areal_gateway.openai.screen:make", {}, name="body screen")
        try:
            doc = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": PAD}]})
            first = screen.answer_of(await off.call(screen.CHAT, doc))
            # A child killed at any moment costs at most one OffloadFailed on this loop too
            # (uvloop raises RuntimeError, not OSError, for a write to a pipe it has closed),
            # never another error; then a new child serves.
            for pause in (0.0, 0.01, 0.05, 0.5):
                old = off.pid
                assert old is not None
                os.kill(old, signal.SIGKILL)
                await asyncio.sleep(pause)
                try:
                    await off.call(screen.CHAT, doc)
                except OffloadFailed:
                    pass
                assert screen.answer_of(await off.call(screen.CHAT, doc)) == first
                assert off.pid not in (None, old)
            return first
        finally:
            await off.close()

    factory = loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        found = runner.run(go())
        assert (found.model, found.stream) == ("m", False)


def test_a_sessions_body_that_grew_by_a_turn_is_not_screened(stack: Stack) -> None:
    """A long agent session's bodies pass the threshold after some 60 turns: once a body of
    the session was answered, its next one, bigger by less than the threshold, is parsed by
    the gateway itself (no detour per turn); a jump by more is screened again, and the admin
    key's huge bodies always are."""
    stack.register("m-screen")
    gw = stack.start_gateway(max_body_bytes=BIG, session_key_secret="s" * 40)
    sid = "sess-" + uuid.uuid4().hex[:24]
    key = gw.gateway.auth.mint_session_key(sid)
    real = gw.gateway.screen.call
    screened: list[int] = []

    async def counting(kind: bytes, body: bytes) -> bytes:
        screened.append(len(body))
        return await real(kind, body)

    gw.gateway.screen.call = counting  # type: ignore[method-assign]
    msgs = [{"role": "user", "content": PAD}]

    def send(auth: str) -> None:
        body = orjson.dumps({"model": "m-screen", "messages": msgs})
        rid, r = _post(gw.url, body, Authorization=f"Bearer {auth}")
        assert r.status_code == 200, r.text
        assert stack.find(rid).body == body

    send(key)
    assert len(screened) == 1, "the session's first huge body is screened"
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "x" * 50_000}]
    send(key)
    assert len(screened) == 1, "a turn more is parsed here"
    msgs += [{"role": "user", "content": PAD}]
    send(key)
    assert len(screened) == 2, "more than the threshold at once is screened"
    send(ADMIN_KEY)
    assert len(screened) == 3
