"""Huge request bodies through the real binaries (gateway and proxy on uvloop, the CPU SGLang
engine behind): each service hands the body to its screen, a child process of its own
(docs/services.md, "Huge requests: the screens"), and the answers are the ones the services
give without it. The screens' own cases are unit-tested in areal-gateway (test_screen.py) and
areal-proxy (test_proxy_stall.py); here: that the binaries start them, that they answer
through the whole stack, and that they end with their service.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from stack import ADMIN_KEY, start_stack
from testpaths import PARROT

MODEL = "tiny-parrot"
TEXT = "lorem ipsum dolor " * 60_000  # ~1 MB: over both screens' 256 KiB threshold


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("huge"), sglang_engine.url, PARROT, n_proxies=1)
    yield s
    s.stop()


def _children(pid: int) -> dict[int, str]:
    """Child pids of `pid` and their command lines."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except FileNotFoundError:
                continue
            out[int(child)] = cmd
    return out


def _screen(pid: int, target: str) -> int | None:
    for child, cmd in _children(pid).items():
        if "areal_runtime.offload" in cmd and target in cmd:
            return child
    return None


def _post(stack, doc: dict | bytes) -> httpx.Response:
    body = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    with httpx.Client(base_url=stack.gateway_url, timeout=120) as c:
        return c.post(
            "/v1/chat/completions",
            content=body,
            headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"},
        )


def test_a_huge_prompt_is_refused_by_the_screens_and_the_stack_serves_on(stack) -> None:
    doc = {"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 4}
    r = _post(stack, doc)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    # The limit named is whichever binds: the model's context (2048), or the engine's learned
    # one (SGLang takes a few tokens fewer than its context: 2042).
    msg = err["message"]
    assert "at least" in msg, msg
    assert "context length is 2048" in msg or "fewer than 2042 tokens" in msg, msg
    gateway_screen = _screen(stack.gateway.popen.pid, "areal_gateway.openai.screen:make")
    proxy_screen = _screen(stack.proxies[0].popen.pid, "areal_proxy.screen:make")
    assert gateway_screen is not None, _children(stack.gateway.popen.pid)
    assert proxy_screen is not None, _children(stack.proxies[0].popen.pid)
    # The same answer for a stream, and a small chat right after, through the openai SDK.
    r = _post(stack, {**doc, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert out.choices[0].finish_reason and out.usage and out.usage.completion_tokens == 4


def test_a_huge_bad_body_gets_the_answer_a_small_one_gets(stack) -> None:
    for doc in (
        {"model": MODEL, "messages": "x"},  # refused by the gateway
        {"messages": [{"role": "user", "content": "x"}]},  # refused by the gateway
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},  # by the proxy
    ):
        small = _post(stack, {**doc, "user": "x"})
        big = _post(stack, {**doc, "user": TEXT})
        assert small.status_code == 400, small.text
        assert (big.status_code, big.json()) == (small.status_code, small.json())


def test_a_huge_body_that_fits_is_answered_as_a_small_one(stack) -> None:
    # ~1 MB that is not prompt: both screens let it through, it crosses gateway -> proxy as
    # a request the gateway encoded itself (a call of its own), and the proxy serves it.
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    small = client.chat.completions.create(**ask, user="x")
    big = client.chat.completions.create(**ask, user=TEXT)
    assert big.choices[0].message.content == small.choices[0].message.content
    assert big.usage == small.usage and big.usage is not None
    streamed = client.chat.completions.create(**ask, user=TEXT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == small.choices[0].message.content


def test_the_screens_end_with_their_service(sglang_engine, tmp_path) -> None:
    s = start_stack(tmp_path / "s", sglang_engine.url, PARROT, n_proxies=1)
    try:
        r = _post(s, {"model": MODEL, "messages": [{"role": "user", "content": TEXT}]})
        assert r.status_code == 400
        screens = [
            _screen(s.gateway.popen.pid, "areal_gateway.openai.screen:make"),
            _screen(s.proxies[0].popen.pid, "areal_proxy.screen:make"),
        ]
        assert None not in screens
    finally:
        s.stop()
    deadline = time.monotonic() + 10
    alive = [pid for pid in screens if pid is not None and _alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if _alive(pid)]
    assert alive == [], "a screen outlived its service"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
