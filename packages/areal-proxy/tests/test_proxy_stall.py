"""One request must never stall the proxy: heavy prompts, slow SQLite and expiry failures
through the real ProxyServer (gRPC on loopback) and a fake engine."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import threading
import time

import grpc
import orjson
import pytest
from proxy_fakes import EOS, PARROT, FakeEngineClient, error_detail, request, start, wait_for

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proxy.common.tokenizer import ModelTokenizer, PromptTooLong
from areal_runtime.session_keys import mint_key, new_id


async def _session(h):
    sid = new_id("sess")
    key = mint_key(sid)
    await h.stub.StartSessions(
        proxy_pb2.StartSessionsRequest(
            task_id="t",
            group_id=new_id("grp"),
            sessions=[proxy_pb2.SessionCredentials(session_id=sid, session_api_key=key)],
        )
    )
    return sid, key


def _stats_probe(h, entered: threading.Event) -> tuple[asyncio.Future[float], threading.Event]:
    """Seconds one GetStats takes once `entered` is set, timed from a thread of its own with
    its own channel (timed on the test's loop, a blocked server loop would block the timer
    too: client and server share it)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{h.server.port}")
    stub = proxy_pb2_grpc.ProxyStatusServiceStub(channel)

    def probe() -> float:
        try:
            stub.GetStats(proxy_pb2.GetStatsRequest(), timeout=10)  # connected before
            ready.set()
            entered.wait(10)
            t0 = time.perf_counter()
            stub.GetStats(proxy_pb2.GetStatsRequest(), timeout=10)
            return time.perf_counter() - t0
        finally:
            channel.close()

    ready = threading.Event()
    fut = asyncio.get_running_loop().run_in_executor(None, probe)
    return fut, ready


def _slow(fn, seconds, entered):
    """`fn`, preceded by a sleep that holds no GIL (as tokenizers' encode or SQLite do)."""

    def slow(*args, **kwargs):
        entered.set()
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized():
    h = await start(FakeEngineClient([5, EOS]))
    try:
        calls = []
        encode = h.tok.encode
        h.tok.encode = lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
        ctx = h.tok.context_length
        # 13 characters at most per token of this vocabulary: this many cannot fit 2048.
        text = "ab " * (13 * ctx // 3 + 10)
        for rpc, body, param in (
            (h.stub.ChatCompletion, {"messages": [{"role": "user", "content": text}]}, "messages"),
            (h.stub.Completion, {"prompt": text}, "prompt"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rpc(request(body))
            d = error_detail(info.value)
            assert (d.http_status, d.code, d.param) == (400, "context_length_exceeded", param)
            assert f"context length is {ctx}" in d.message and "at least" in d.message
        assert calls == [], "the prompt was tokenized although its length alone rules it out"
        # A prompt the bound cannot rule out is tokenized, and still refused when too long.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Completion(request({"prompt": "ab " * (ctx + 5)}))
        assert error_detail(info.value).code == "context_length_exceeded"
        assert calls, "a prompt within the bound is tokenized"
        assert h.engine.requests == []
    finally:
        await h.close()


async def test_stats_and_small_chats_answer_while_a_big_prompt_is_tokenized():
    # A context that holds a 25 kB prompt (10 k tokens of this vocabulary).
    h = await start(FakeEngineClient([5, EOS]), context_length=100_000)
    try:
        entered = threading.Event()
        h.tok.encode = _slow(h.tok.encode, 1.5, entered)
        big = {"messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 2}
        stats, ready = _stats_probe(h, entered)
        await wait_for(ready.is_set)
        task = asyncio.ensure_future(h.chat(big))
        await wait_for(entered.is_set)
        assert await stats < 0.5, "GetStats waited for the tokenizer"
        # A small chat is tokenized inline (cheaper than a thread hop): the encode spy delays
        # it too, so it goes through the completion path with token ids.
        t0 = time.perf_counter()
        await h.completion({"prompt": [1, 2, 3], "max_tokens": 2})
        assert time.perf_counter() - t0 < 0.5
        assert not task.done()
        r = await task
        assert r["choices"][0]["finish_reason"]
    finally:
        await h.close()


async def test_stats_answer_while_sqlite_is_slow():
    h = await start(FakeEngineClient([5, EOS]))
    try:
        sid, key = await _session(h)
        entered = threading.Event()
        store = h.server.store
        store.session = _slow(store.session, 1.5, entered)
        msgs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        stats, ready = _stats_probe(h, entered)
        await wait_for(ready.is_set)
        task = asyncio.ensure_future(h.chat(msgs, api_key=key, session_id=sid))
        await wait_for(entered.is_set, within=5)
        assert await stats < 0.5, "GetStats waited for SQLite"
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert stats.sessions == 1
        await task
        assert store.interaction_count() == 1
    finally:
        await h.close()


async def test_session_expiry_survives_a_failing_pass(caplog):
    h = await start(FakeEngineClient([5, EOS]), session_ttl=1.0)
    try:
        sid, _ = await _session(h)
        book = h.server.book
        expire = book.expire
        failures = []

        def flaky(now=None):
            if not failures:
                failures.append(1)
                raise sqlite3.OperationalError("database is locked")
            return expire(now)

        book.expire = flaky
        with caplog.at_level(logging.ERROR, logger="areal_proxy"):
            # Passes run every second: the first fails, a later one ends the idle session.
            await wait_for(lambda: h.server.store.live_session_count() == 0, within=6.0)
        assert failures and h.server.store.session(sid).ended_at is not None
        assert not h.server._expiry_task.done()
        assert "session expiry failed" in caplog.text
    finally:
        await h.close()


def test_long_prompts_are_tokenized_without_holding_the_gil():
    tok = ModelTokenizer.from_dir(PARROT)
    text = "hello wörld <|im_start|> foo  bar\n" * 60_000  # 2 MB: about a second to encode
    assert tok.encode(text) == tok.tokenizer.encode(text).ids
    assert tok.encode(text, add_special_tokens=True) == (
        tok.tokenizer.encode(text, add_special_tokens=True).ids
    )
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    ticks = 0
    worker.start()
    while not done.is_set():  # what the event loop gets while a worker thread tokenizes
        time.sleep(0.001)
        ticks += 1
    worker.join()
    # Holding the GIL, `Tokenizer.encode` let this loop run a handful of times in all.
    assert ticks >= 50, f"the main thread ran only {ticks} times while the prompt was encoded"


async def test_a_session_turn_that_cannot_fit_is_refused_before_its_turn_is_looked_up():
    h = await start(FakeEngineClient([5, EOS]))
    try:
        sid, key = await _session(h)
        looked_up = []
        begin_turn = h.server.book.begin_turn
        h.server.book.begin_turn = lambda *a: looked_up.append(1) or begin_turn(*a)
        text = "ab " * (13 * h.tok.context_length // 3 + 10)
        body = {"messages": [{"role": "user", "content": text}]}
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.chat(body, api_key=key, session_id=sid)
        assert error_detail(info.value).code == "context_length_exceeded"
        assert looked_up == [], "the lineage hashed a prompt that could never fit"
        await h.chat({"messages": [{"role": "user", "content": "hi"}]}, api_key=key, session_id=sid)
        assert looked_up == [1]
    finally:
        await h.close()


def test_a_prompt_over_the_limit_is_counted_not_listed():
    tok = ModelTokenizer.from_dir(PARROT)
    for text in ("hello world " * 10, "hello world " * 1000):  # the plain and the batch path
        n = len(tok.encode(text))
        with pytest.raises(PromptTooLong) as info:
            tok.encode(text, limit=n)
        assert (info.value.tokens, info.value.exact) == (n, True)
        assert len(tok.encode(text, limit=n + 1)) == n


def test_a_huge_prompt_over_the_limit_is_refused_after_the_pieces_that_prove_it():
    tok = ModelTokenizer.from_dir(PARROT)
    text = " ".join(f"w{i % 977}x{i % 13}" for i in range(200_000))  # ~1.6 MB, many pieces
    n = len(tok.encode(text))
    batches: list[int] = []
    real = tok.tokenizer.encode_batch_fast

    def counting(pieces, **kw):
        batches.append(sum(len(p) for p in pieces))
        return real(pieces, **kw)

    tok.tokenizer = _Spy(tok.tokenizer, counting)
    with pytest.raises(PromptTooLong) as info:
        tok.encode(text, limit=n // 8)
    assert not info.value.exact and n // 8 <= info.value.tokens < n
    assert sum(batches) < len(text) // 2  # stopped early, and never encoded it whole
    # Near the limit the pieces prove nothing: the exact count decides, both ways.
    with pytest.raises(PromptTooLong) as info:
        tok.encode(text, limit=n)
    assert (info.value.tokens, info.value.exact) == (n, True)
    assert tok.encode(text, limit=n + 1) == real([text], add_special_tokens=False)[0].ids


class _Spy:
    def __init__(self, inner, batch):
        self._inner, self.encode_batch_fast = inner, batch

    def __getattr__(self, name):
        return getattr(self._inner, name)


# --- the prompt screen: huge prompts that cannot fit, refused from a child process ----------


def _huge_words(chars: int) -> str:
    return " ".join(f"w{i % 977}x{i % 13}" for i in range(chars // 8))[:chars]


async def test_a_huge_prompt_that_cannot_fit_is_refused_without_this_process_tokenizing_it():
    # 1.2 MB of text is ~500 k tokens here: the length bound cannot rule it out against a
    # context of 200 k, so before the screen the proxy tokenized it on its own GIL.
    h = await start(FakeEngineClient([5, EOS]), context_length=200_000)
    try:
        calls = []
        encode = h.tok.encode
        h.tok.encode = lambda text, **kw: calls.append(len(text)) or encode(text, **kw)
        text = _huge_words(1_200_000)
        assert h.tok.min_tokens(text) < 200_000
        for rpc, body, param in (
            (h.stub.ChatCompletion, {"messages": [{"role": "user", "content": text}]}, "messages"),
            (h.stub.Completion, {"prompt": ["hi", text]}, "prompt[1]"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rpc(request(body))
            d = error_detail(info.value)
            assert (d.http_status, d.code, d.param) == (400, "context_length_exceeded", param)
            assert "context length is 200000" in d.message
        assert calls == [], "this process tokenized a prompt the screen had refused"
        assert h.server.screen.pid is not None and h.server.screen.pid != os.getpid()
        assert h.engine.requests == []
    finally:
        await h.close()
    assert h.server.screen.pid is None, "the screen outlived the proxy's shutdown"


async def test_a_huge_prompt_that_fits_and_a_dead_screen_go_on_as_before():
    h = await start(FakeEngineClient([5, EOS]), context_length=1_000_000)
    try:
        text = _huge_words(400_000)  # fits a context of 1 M
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
        r = await h.chat(body)
        assert r["choices"][0]["finish_reason"] and r["usage"]["prompt_tokens"] > 100_000
        first = h.server.screen.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        # The screen is gone: the proxy checks the prompt itself, and the next huge one
        # starts a new screen.
        r = await h.chat(body)
        assert r["choices"][0]["finish_reason"]
        r = await h.chat(body)
        assert h.server.screen.pid not in (None, first)
        # A malformed huge body gets the proxy's own answer, not the screen's.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.ChatCompletion(request(b'{"messages": 5, "x": "' + b"y" * 300_000 + b'"}'))
        assert error_detail(info.value).http_status == 400
    finally:
        await h.close()


async def test_gradual_growth_of_an_expensive_field_is_screened_then_refused():
    """A session grows a list of empty objects by ~250 KiB a turn: within the long-session
    allowance, so bytes alone let every turn be parsed on this loop. By its estimated cost
    (areal_runtime.bodycost) the turn over the loop's budget goes to the screen and the one
    over the structure limit is refused there (413 body_too_complex), flood included."""
    from areal_runtime import bodycost

    h = await start(FakeEngineClient([5, EOS]), context_length=1_000_000)
    try:
        sid, key = await _session(h)
        real = h.server.screen.call
        screened: list[int] = []

        async def counting(kind: bytes, body: bytes) -> bytes:
            screened.append(len(body))
            return await real(kind, body)

        h.server.screen.call = counting
        pad: list[dict] = []
        seen = []
        for _ in range(4):
            body = orjson.dumps(
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "metadata": {"pad": pad},
                    "max_tokens": 1,
                }
            )
            before = len(screened)
            try:
                await h.stub.ChatCompletion(request(body, api_key=key, session_id=sid))
                status = 200
            except grpc.aio.AioRpcError as exc:
                d = error_detail(exc)
                assert d.code == "body_too_complex", d
                status = d.http_status
            seen.append((status, bodycost.parses_inline(body), len(screened) > before))
            if status != 200:
                break
            pad = pad + [{}] * (250 * 1024 // 3)
        assert seen == [(200, True, False), (200, False, True), (413, False, True)]
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.stub.ChatCompletion(request(body, api_key=key, session_id=sid))
            assert error_detail(info.value).code == "body_too_complex"
        assert len(h.engine.requests) == 2
    finally:
        await h.close()
