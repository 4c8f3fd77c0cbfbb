"""Long RL sessions through real binaries (gateway, router, data proxy, SGLang on the CPU with
the parrot model): a session's chat turn that extends its previous one continues its prompt
(`hf`: only what follows the last special-token cut is tokenized; `concat`: the previous
turn's exact ids go on), and the ids are still exactly the full path's.

- 30 turns, whole and streamed, tool calls and results in the conversation: every prompt of
  the export is its messages' full tokenization (`hf`) or the exact continuation of the turn
  before (`concat`); every output is what the SDK got; 29 incremental builds, no fallback.
- Fallbacks (an edited message, a new system prompt, tools added mid-session) are counted by
  reason and answered right.
- A proxy SIGKILLed after 10 turns and restarted on its port and database: the session goes
  on, its first turn after the restart a `not_cached` fallback, the later ones incremental.
- Two turns of one session in flight at once, both extending the same turn.

Each turn's prompt path is the change of the proxy's prompt counters across it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import pytest
from long_sessions import (
    CACHE_BYTES,
    TOKENIZED,
    TOOLS,
    Reference,
    Session,
    Turn,
    ask,
    by_interaction,
    check_concat,
    check_hf,
    counted,
    echoed,
    export_rows,
    prompt_counts,
    split,
    tool_exchange,
    user,
)
from stack import launch, metric, proxy_argv, start_stack, wait_healthy
from testpaths import PARROT

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"
MAX_TOKENS = 8
TURNS = 30
SYSTEM = {"role": "system", "content": "You are a terse assistant with a lookup tool."}


@pytest.fixture(scope="module")
def ref():
    return Reference(PARROT)


@pytest.fixture(scope="module")
def hf_stack(sglang_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("long-hf"),
        sglang_engine.url,
        PARROT,
        n_proxies=1,
        proxy_args=["--chat-template-type", "hf"],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def concat_stack(sglang_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("long-concat"),
        sglang_engine.url,
        PARROT,
        n_proxies=1,
        proxy_args=["--chat-template-type", "concat"],
    )
    yield s
    s.stop()


def last_cut(ref: Reference, ids: list[int]) -> int:
    """Where the last added token of a prompt starts: the ids before it are kept (hf)."""
    added = {t["id"] for t in ref.tok.added_tokens}
    return max(i for i, t in enumerate(ids) if t in added)


def test_thirty_turns_hf_equal_the_full_tokenization(hf_stack, ref):
    proxy = hf_stack.proxies[0]
    before, tokenized_before = prompt_counts(proxy), metric(proxy, TOKENIZED)
    sess = Session(hf_stack, MODEL, MAX_TOKENS, proxy, messages=[SYSTEM])
    turns = sess.run(0, TURNS)
    # 7 turns streamed, 10 with a tool call and its result in the conversation.
    assert sum(t.stream for t in turns) == 7
    assert sum(t.messages[-3].get("tool_calls") is not None for t in turns[1:]) == 10
    assert [t.path for t in turns] == ["full"] + ["incremental"] * (TURNS - 1)
    assert counted(before, prompt_counts(proxy)) == {"full": 1, "incremental": TURNS - 1}
    rows = export_rows(hf_stack, sess.session_id)
    assert [r["interaction_id"] for r in rows] == [t.answer.id for t in turns]
    check_hf(ref, rows, turns)
    # Only the text from the previous prompt's last cut on was tokenized.
    prompts = [split(r)[0] for r in rows]
    want = len(prompts[0]) + sum(len(p) - last_cut(ref, q) for q, p in pairwise(prompts))
    assert metric(proxy, TOKENIZED) - tokenized_before == want
    assert want < sum(len(p) for p in prompts) / 4
    assert metric(proxy, CACHE_BYTES) > 0


def test_thirty_turns_concat_continue_the_exact_ids(concat_stack, ref):
    proxy = concat_stack.proxies[0]
    before, tokenized_before = prompt_counts(proxy), metric(proxy, TOKENIZED)
    sess = Session(concat_stack, MODEL, MAX_TOKENS, proxy, messages=[SYSTEM])
    turns = sess.run(0, TURNS)
    assert [t.path for t in turns] == ["full"] + ["incremental"] * (TURNS - 1)
    assert counted(before, prompt_counts(proxy)) == {"full": 1, "incremental": TURNS - 1}
    rows = export_rows(concat_stack, sess.session_id)
    assert [r["interaction_id"] for r in rows] == [t.answer.id for t in turns]
    check_concat(ref, rows, turns)
    # Only what follows the previous prompt + output was tokenized.
    parts = [split(r) for r in rows]
    want = len(parts[0][0]) + sum(
        len(p) - len(q) - len(o) for (q, o, _), (p, _, _) in pairwise(parts)
    )
    assert metric(proxy, TOKENIZED) - tokenized_before == want
    # One token stream: the concat export is one row with every turn's output trainable.
    [row] = export_rows(concat_stack, sess.session_id, style="concat")
    assert row["interaction_ids"] == [t.answer.id for t in turns]
    assert row["input_ids"] == rows[-1]["input_ids"]
    assert sum(row["loss_mask"]) == sum(len(o) for _, o, _ in parts)


def test_fallbacks_are_counted_and_answered_right(hf_stack, ref):
    proxy = hf_stack.proxies[0]
    before = prompt_counts(proxy)
    sess = Session(hf_stack, MODEL, MAX_TOKENS, proxy, messages=[SYSTEM])
    sess.run(0, 4)
    base = list(sess.messages)
    # Tools the template renders, sent for the first time mid-session: the turn extends the
    # last one, whose rendering changes (the system prompt moves into the tools header).
    with_tools = [*base, user(10)]
    t = sess.send(with_tools, tools=TOOLS)
    assert t.path == "full:render_changed"
    # The same tools again: continued.
    t = sess.send([*with_tools, echoed(t.answer), user(11)], tools=TOOLS, stream=True)
    assert t.path == "incremental"
    # An earlier message edited: the messages extend no recorded turn.
    edited = [dict(m) for m in base] + [user(12)]
    edited[1] = {"role": "user", "content": "Question 0, asked differently."}
    t = sess.send(edited)
    assert t.path == "full:history_edited"
    t = sess.send([*edited, echoed(t.answer), *tool_exchange(13), user(13)])
    assert t.path == "incremental"
    # A new system prompt: likewise.
    t = sess.send([{"role": "system", "content": "Be verbose."}, *base[1:], user(14)])
    assert t.path == "full:history_edited"
    # Full: the session's first turn and the three fallbacks.
    assert counted(before, prompt_counts(proxy)) == {
        "full": 4,
        "incremental": 5,
        "history_edited": 2,
        "render_changed": 1,
    }
    check_hf(ref, export_rows(hf_stack, sess.session_id), sess.turns)


def test_proxy_killed_mid_session_restarts_and_the_session_goes_on(sglang_engine, tmp_path, ref):
    hf = ["--chat-template-type", "hf"]
    s = start_stack(
        tmp_path / "long-restart", sglang_engine.url, PARROT, n_proxies=1, proxy_args=hf
    )
    try:
        sess = Session(s, MODEL, MAX_TOKENS, s.proxies[0], messages=[SYSTEM])
        sess.run(0, 10)
        victim = s.proxies[0]
        os.killpg(victim.comp.pgid, signal.SIGKILL)
        victim.popen.wait(timeout=10)
        argv = proxy_argv(s, sglang_engine.url, MODEL, PARROT, 0, hf, port=victim.info["port"])
        s.proxies[0] = sess.proxy = launch(victim.comp.name, argv, s.log_dir, s.env)
        wait_healthy(s, MODEL, 1)
        sess.run(10, 6)
        assert [t.path for t in sess.turns] == [
            "full",
            *["incremental"] * 9,
            "full:not_cached",
            *["incremental"] * 5,
        ]
        assert prompt_counts(s.proxies[0]) == {
            "incremental": 5,
            "full": 1,
            "not_cached": 1,
            "new_conversation": 0,
            "history_edited": 0,
            "render_changed": 0,
            "boundary_unknown": 0,
            "tokenizer_unsupported": 0,
        }
        rows = export_rows(s, sess.session_id)
        assert [r["interaction_id"] for r in rows] == [t.answer.id for t in sess.turns]
        check_hf(ref, rows, sess.turns)
    finally:
        s.stop()


def test_two_turns_of_one_session_in_flight_at_once(hf_stack, ref):
    proxy = hf_stack.proxies[0]
    sess = Session(hf_stack, MODEL, MAX_TOKENS, proxy, messages=[SYSTEM])
    sess.run(0, 3)
    # A harness running two tool calls side by side: both requests extend the same turn.
    branches = [
        [*sess.messages, user(40)],
        [*sess.messages, *tool_exchange(41), user(41)],
    ]
    before = prompt_counts(proxy)
    gate = threading.Barrier(2)
    times: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]

    def one(k: int) -> Turn:
        gate.wait(timeout=30)
        t0 = time.monotonic()
        # Long enough answers (the parrot never stops early) for the two to overlap.
        a = ask(sess.client, MODEL, branches[k], max_tokens=48, stream=k == 1)
        times[k] = (t0, time.monotonic())
        return Turn(branches[k], a, stream=k == 1)

    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(one, range(2)))
    (a0, a1), (b0, b1) = times
    assert a0 < b1 and b0 < a1, f"the two turns did not overlap: {times}"
    assert counted(before, prompt_counts(proxy)) == {"incremental": 2}
    # A next turn continues one of the branches.
    nxt = sess.send([*branches[1], echoed(both[1].answer), user(42)])
    assert nxt.path == "incremental"
    rows = export_rows(hf_stack, sess.session_id)
    assert set(by_interaction(rows)) == {t.answer.id for t in [*sess.turns, *both]}
    check_hf(ref, rows, [*sess.turns, *both])
