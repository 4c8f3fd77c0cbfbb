"""RL recording end to end: sessions, rewards, trajectories, weight versions (real SGLang, CPU).

Clients use the official `openai` SDK with session keys; the RL and admin APIs are
called over plain HTTP. The parrot model makes every answer known in advance.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from stack import ADMIN_KEY, launch, proxy_argv, start_stack, wait_healthy, workers
from testpaths import PARROT, RANDOM
from tokenizers import Tokenizer

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(PARROT / "tokenizer.json"))


def admin(stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
    )


def as_key(stack, key) -> httpx.Client:
    return httpx.Client(
        base_url=stack.gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def start_group(stack, size=1, task="t"):
    with admin(stack) as c:
        r = c.post("/rl/start_session", json={"task_id": task, "group_size": size})
    assert r.status_code == 201, r.text
    return r.json()


def export(stack, **body):
    with admin(stack) as c:
        r = c.post("/rl/export_trajectories", json=body)
    assert r.status_code == 200, r.text
    return r.json()["rows"]


def export_removing(stack, **body):
    """An export with removal and its acknowledgement (what removes the sessions)."""
    with admin(stack) as c:
        r = c.post("/rl/export_trajectories", json={**body, "remove_session": True})
        assert r.status_code == 200, r.text
        doc = r.json()
        a = c.post("/rl/ack_export", json={"export_id": doc["export_id"]})
    assert a.status_code == 200, a.text
    return doc["rows"], a.json()


def chat_turns(stack, session, n):
    c = openai.OpenAI(
        base_url=stack.gateway_url + "/v1", api_key=session["session_api_key"], max_retries=0
    )
    msgs = [{"role": "user", "content": session["session_id"]}]
    for _ in range(n):
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "more"},
        ]


def engine_tokens(engine_url, ids, n):
    out = httpx.post(
        engine_url + "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": n, "temperature": 0},
            "return_logprob": True,
        },
        timeout=60,
    ).json()
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def render(messages, generation_prompt=True):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


@pytest.fixture(scope="module")
def concat_stack(sglang_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("rl-concat"),
        sglang_engine.url,
        PARROT,
        policy="least_loaded",
        proxy_args=["--chat-template-type", "concat", "--set-reward-finish-timeout", "30"],
    )
    yield s
    s.stop()


def test_three_turn_session_concat_is_one_token_stream(concat_stack, sglang_engine, tok):
    g = start_group(concat_stack)
    [sess] = g["sessions"]
    client = openai.OpenAI(
        base_url=concat_stack.gateway_url + "/v1", api_key=sess["session_api_key"], max_retries=0
    )
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = []
    for turn in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
        ids.append(r.id)
        msgs = [
            *msgs,
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"and then {turn}?"},
        ]
    [row] = export(concat_stack, session_ids=[sess["session_id"]], style="concat")
    assert row["interaction_ids"] == ids
    tokens, mask = row["input_ids"], row["loss_mask"]
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    assert len(spans) == 3, spans
    conversation = msgs[:-1]  # the last user message was never sent
    for k, (a, b) in enumerate(spans):
        # The prompt before each answer is the tokenizer's template of the conversation so far.
        prompt_text = tok.decode(tokens[:a], skip_special_tokens=False)
        assert prompt_text == render(conversation[: 2 * k + 1]), k
        # The answer is exactly what the engine generates for that prompt.
        want_ids, want_lps = engine_tokens(sglang_engine.url, tokens[:a], 3)
        assert tokens[a:b] == want_ids
        assert row["logprobs"][a:b] == pytest.approx(want_lps, abs=1e-4)
        assert row["versions"][a:b] == [row["versions"][a]] * (b - a) and row["versions"][a] >= 0
    assert all(v == -1 for v, m in zip(row["versions"], mask, strict=True) if not m)


def test_individual_rows_and_discount(concat_stack):
    g = start_group(concat_stack)
    [sess] = g["sessions"]
    key = sess["session_api_key"]
    client = openai.OpenAI(base_url=concat_stack.gateway_url + "/v1", api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "go"}]
    ids = []
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
        ids.append(r.id)
        msgs = [
            *msgs,
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "again"},
        ]
    with as_key(concat_stack, key) as c:
        assert (
            c.post("/rl/set_reward", json={"interaction_id": ids[1], "reward": 1.0}).status_code
            == 200
        )
        r = c.post("/rl/set_reward", json={"reward": 2.0})
        assert r.status_code == 200 and r.json()["interaction_id"] == ids[2]
    rows = export(concat_stack, session_ids=[sess["session_id"]], style="individual", discount=0.5)
    assert [r["interaction_id"] for r in rows] == ids
    # r_i += 0.5 * r_{i+1}: [0 + 0.5 * 2.0, 1 + 0.5 * 2.0, 2.0]
    assert [r["reward"] for r in rows] == [1.0, 2.0, 2.0]
    for r in rows:
        assert (
            len(r["input_ids"]) == len(r["loss_mask"]) == len(r["logprobs"]) == len(r["versions"])
        )
        assert (
            r["loss_mask"][-2:] == [1, 1] and r["group_id"] == g["group_id"] and r["task_id"] == "t"
        )


def test_groups_live_on_one_proxy_and_spread(sglang_engine, tmp_path):
    # A stack of its own: two groups spread only over proxies that start equally loaded.
    concat_stack = start_stack(tmp_path / "rl-groups", sglang_engine.url, PARROT)
    try:
        _groups_spread(concat_stack)
    finally:
        concat_stack.stop()


def _groups_spread(concat_stack):
    before = {w["proxy_id"]: int(w.get("sessions", 0)) for w in workers(concat_stack)}
    g1, g2 = start_group(concat_stack, 4), start_group(concat_stack, 4)
    time.sleep(1.5)  # the router polls the proxies' session counts
    after = {w["proxy_id"]: int(w.get("sessions", 0)) for w in workers(concat_stack)}
    grew = {p: after[p] - before.get(p, 0) for p in after}
    # Each proxy took one whole group (4 sessions; the router may also count the group's own pin).
    assert len(grew) == 2 and all(v in (4, 5) for v in grew.values()), f"groups must spread: {grew}"
    for g in (g1, g2):
        # Every member answers through the same proxy: one export by group has every session.
        for s in g["sessions"]:
            c = openai.OpenAI(
                base_url=concat_stack.gateway_url + "/v1",
                api_key=s["session_api_key"],
                max_retries=0,
            )
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
        rows = export(concat_stack, group_id=g["group_id"])
        assert sorted(r["session_id"] for r in rows) == sorted(
            s["session_id"] for s in g["sessions"]
        )


def pinned(stack) -> int:
    """Sessions (and group pins) the router has pinned, over every proxy."""
    return sum(int(w.get("sessions", 0)) for w in workers(stack))


def test_session_keys_and_bad_payloads(concat_stack):
    pins_before = pinned(concat_stack)
    g = start_group(concat_stack, 2)
    assert pinned(concat_stack) == pins_before + 3  # the group pin and its two sessions
    (a, b) = g["sessions"]
    with as_key(concat_stack, a["session_api_key"]) as c:
        cases = [
            (c.post("/rl/set_reward", json={"session_id": b["session_id"], "reward": 1}), 403),
            (c.post("/rl/export_trajectories", json={"session_ids": [b["session_id"]]}), 403),
            (c.post("/rl/export_trajectories", json={"group_id": g["group_id"]}), 403),
            (c.post("/rl/start_session", json={"task_id": "x"}), 403),
            (c.post("/rl/set_reward", json={"reward": "high"}), 400),
            (c.post("/rl/set_reward", json={}), 400),
            (c.post("/rl/set_reward", json={"reward": 1.0}), 409),  # nothing to reward yet
            (
                c.post(
                    "/rl/set_reward",
                    content=b"{not json",
                    headers={"content-type": "application/json"},
                ),
                400,
            ),
            (c.post("/admin/pause", json={}), 403),
        ]
    with admin(concat_stack) as c:
        cases += [
            (c.post("/rl/export_trajectories", json={"group_id": "group-unknown"}), 404),
            (c.post("/rl/set_reward", json={"session_id": "sess-unknown", "reward": 1}), 404),
            (c.post("/rl/start_session", json={"group_size": 0}), 400),
            (c.post("/rl/start_session", json={"model": "nope"}), 404),
            (
                c.post(
                    "/rl/export_trajectories", json={"group_id": g["group_id"], "style": "zigzag"}
                ),
                400,
            ),
        ]
    forged = "areal-sk-" + a["session_id"] + ".not-the-secret"
    client = openai.OpenAI(base_url=concat_stack.gateway_url + "/v1", api_key=forged, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    for r, status in cases:
        assert r.status_code == status, (r.request.url, r.text)
        assert r.json()["error"]["message"]
    # Double export: the same rows again; with removal, the same rows, and nothing removed
    # until the acknowledgement; after it, gone.
    first = export(concat_stack, group_id=g["group_id"])
    assert export(concat_stack, group_id=g["group_id"]) == first
    assert export(concat_stack, group_id=g["group_id"], remove_session=True) == first
    assert export(concat_stack, group_id=g["group_id"]) == first
    rows, ack = export_removing(concat_stack, group_id=g["group_id"])
    assert rows == first and sorted(ack["removed"]) == sorted(
        s["session_id"] for s in g["sessions"]
    )
    with admin(concat_stack) as c:
        assert (
            c.post("/rl/export_trajectories", json={"group_id": g["group_id"]}).status_code == 404
        )
    # The router's pins went with the group: the group pin and both sessions'.
    assert pinned(concat_stack) == pins_before


def test_export_streams_jsonl(concat_stack):
    g = start_group(concat_stack, 3)
    for s in g["sessions"]:
        c = openai.OpenAI(
            base_url=concat_stack.gateway_url + "/v1", api_key=s["session_api_key"], max_retries=0
        )
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    with (
        admin(concat_stack) as c,
        c.stream(
            "POST",
            "/rl/export_trajectories",
            json={"group_id": g["group_id"]},
            headers={"Accept": "application/x-ndjson"},
        ) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [line for line in r.iter_lines() if line]
    assert len(lines) == 3


def test_ndjson_client_gone_mid_stream_loses_nothing(concat_stack):
    pins_before = pinned(concat_stack)
    g = start_group(concat_stack, 4)
    for s in g["sessions"]:
        chat_turns(concat_stack, s, 3)
    everything = export(concat_stack, group_id=g["group_id"], style="individual")
    assert len(everything) == 12
    body = {"group_id": g["group_id"], "remove_session": True, "style": "individual"}
    ndjson = {"Accept": "application/x-ndjson"}
    # The client reads a few lines and goes away (the gateway and the proxy may well have sent
    # everything by then: the server cannot know what the client kept).
    with (
        admin(concat_stack) as c,
        c.stream("POST", "/rl/export_trajectories", json=body, headers=ndjson) as r,
    ):
        assert r.status_code == 200
        cut_export_id = r.headers.get("x-areal-export-id")
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
    assert [json.loads(x) for x in got] == everything[:3]
    time.sleep(0.5)  # whatever the gateway still does with the cut stream
    # Every row is still there, and the pins are too.
    assert export(concat_stack, group_id=g["group_id"], style="individual") == everything
    assert pinned(concat_stack) == pins_before + 5
    assert cut_export_id  # the export had an id to acknowledge, and nobody did
    # Read whole, then acknowledged: removed, pins released.
    with admin(concat_stack) as c:
        with c.stream("POST", "/rl/export_trajectories", json=body, headers=ndjson) as r:
            rows = [json.loads(x) for x in r.iter_lines() if x]
            export_id = r.headers["x-areal-export-id"]
        assert rows == everything
        a = c.post("/rl/ack_export", json={"export_id": export_id})
        assert a.status_code == 200 and len(a.json()["removed"]) == 4, a.text
        assert (
            c.post("/rl/export_trajectories", json={"group_id": g["group_id"]}).status_code == 404
        )
    assert pinned(concat_stack) == pins_before


def _proxy_of(stack, start):
    """(the group `start()` made, the index of the proxy that holds it)."""
    before = {w["proxy_id"]: int(w.get("sessions", 0)) for w in workers(stack)}
    g = start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)  # the router polls the proxies' session counts
        after = {w["proxy_id"]: int(w.get("sessions", 0)) for w in workers(stack)}
        grew = [p for p in after if after[p] > before.get(p, 0)]
        if len(grew) == 1:
            [pid] = grew
            return g, [p.comp.name for p in stack.proxies].index(pid)
    raise AssertionError(f"no single proxy took the group: {before} -> {after}")


def test_json_export_failing_on_a_second_proxy_removes_nothing(sglang_engine, tmp_path):
    # A short request timeout: the export's call to a stopped proxy ends in seconds.
    s = start_stack(
        tmp_path / "rl-2phase", sglang_engine.url, PARROT, gateway_args=["--request-timeout", "8"]
    )
    try:
        g1, first = _proxy_of(s, lambda: start_group(s, 2))
        g2, second = _proxy_of(s, lambda: start_group(s, 2))
        assert first != second, "the two groups must be on the two proxies"
        for sess in [*g1["sessions"], *g2["sessions"]]:
            chat_turns(s, sess, 2)
        ids1 = [x["session_id"] for x in g1["sessions"]]
        ids2 = [x["session_id"] for x in g2["sessions"]]
        ids = ids1 + ids2  # the first proxy's part is read first
        everything = export(s, session_ids=ids, style="individual")
        assert len(everything) == 8
        pins = pinned(s)
        body = {"session_ids": ids, "remove_session": True, "style": "individual"}
        victim = s.proxies[second]
        # The second proxy hangs mid-export (SIGSTOP): the request fails, the first proxy's
        # part was read and is still there.
        os.killpg(victim.comp.pgid, signal.SIGSTOP)
        try:
            with admin(s) as c:
                r = c.post("/rl/export_trajectories", json=body)
            assert r.status_code >= 500, r.text
        finally:
            os.killpg(victim.comp.pgid, signal.SIGCONT)
        assert export(s, session_ids=ids, style="individual") == everything
        # The second proxy dies (SIGKILL): the same, and it comes back with its records.
        os.killpg(victim.comp.pgid, signal.SIGKILL)
        victim.popen.wait(timeout=10)
        with admin(s) as c:
            r = c.post("/rl/export_trajectories", json=body)
        assert r.status_code >= 500, r.text
        assert export(s, session_ids=ids1, style="individual") == everything[:4]
        argv = proxy_argv(s, sglang_engine.url, MODEL, PARROT, second, [], port=victim.info["port"])
        s.proxies[second] = launch(victim.comp.name, argv, s.log_dir, s.env)
        wait_healthy(s, MODEL, 2)
        assert pinned(s) == pins
        # Back: an export with removal returns everything, and its ack removes everything.
        rows, ack = export_removing(s, session_ids=ids, style="individual")
        assert rows == everything
        assert sorted(ack["removed"]) == sorted(ids) and ack["kept"] == []
        with admin(s) as c:
            assert c.post("/rl/export_trajectories", json={"session_ids": ids}).status_code == 404
            again = c.post("/rl/ack_export", json={"export_id": "exp-x.WyJncm91cDp4Il0"})
            assert again.status_code == 200 and again.json()["removed"] == []
        assert pinned(s) == 0  # the groups emptied: their pins and their sessions' went
    finally:
        s.stop()


def test_weight_update_mid_stream_switches_model_and_versions(sglang_engine, tmp_path):
    """Random tiny model at version 0 -> parrot pushed mid-stream -> version 1 from that token on."""
    s = start_stack(tmp_path / "rl-weights", sglang_engine.url, PARROT, n_proxies=1)
    try:
        with admin(s) as c:
            r = c.post("/admin/update_weights", json={"path": str(RANDOM), "version": 0})
            assert r.status_code == 200, r.text
        g = start_group(s)
        [sess] = g["sessions"]
        client = openai.OpenAI(
            base_url=s.gateway_url + "/v1", api_key=sess["session_api_key"], max_retries=0
        )
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "talk"}],
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish, pushed = [], None, False
        for chunk in stream:
            for ch in chunk.choices:
                text.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
            if not pushed and len(text) > 20:
                with admin(s) as c:
                    r = c.post("/admin/update_weights", json={"path": str(PARROT)})
                assert r.status_code == 200, r.text
                assert r.json()["version"] == 1
                pushed = True
        assert finish == "length", "the stream completes; nothing lost"
        [row] = export(s, session_ids=[sess["session_id"]])
        out = [
            (t, v)
            for t, v, m in zip(row["input_ids"], row["versions"], row["loss_mask"], strict=True)
            if m
        ]
        assert len(out) == 400
        versions = [v for _, v in out]
        switch = versions.index(1)
        assert 0 < switch < 400 and versions == [0] * switch + [1] * (400 - switch)
        tokens = [t for t, _ in out]
        # From the switch on the parrot repeats the last token it was given.
        assert set(tokens[switch:]) == {tokens[switch - 1]}
        assert len(set(tokens[:switch])) > 1, "the random model's tokens vary"
    finally:
        with contextlib_suppress():
            with admin(s) as c:
                c.post("/admin/update_weights", json={"path": str(PARROT), "version": 0})
        s.stop()


def contextlib_suppress():
    import contextlib

    return contextlib.suppress(Exception)


def test_sigkill_after_reward_loses_nothing(sglang_engine, tmp_path):
    s = start_stack(tmp_path / "rl-kill", sglang_engine.url, PARROT, n_proxies=1)
    try:
        g = start_group(s)
        [sess] = g["sessions"]
        client = openai.OpenAI(
            base_url=s.gateway_url + "/v1", api_key=sess["session_api_key"], max_retries=0
        )
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
        with as_key(s, sess["session_api_key"]) as c:
            assert c.post("/rl/set_reward", json={"reward": 0.5}).status_code == 200
        victim = s.proxies[0]
        os.killpg(victim.comp.pgid, signal.SIGKILL)
        victim.popen.wait(timeout=10)
        port = victim.info["port"]
        argv = proxy_argv(s, sglang_engine.url, MODEL, PARROT, 0, [], port=port)
        s.proxies[0] = launch(victim.comp.name, argv, s.log_dir, s.env)
        wait_healthy(s, MODEL, 1)
        [row] = export(s, group_id=g["group_id"])
        assert row["interaction_id"] == r.id and row["reward"] == 0.5
        assert sum(row["loss_mask"]) == 3
    finally:
        s.stop()


async def test_thousand_sessions_three_turns_bounded_memory(sglang_engine, tmp_path):
    s = start_stack(tmp_path / "rl-scale", sglang_engine.url, PARROT, n_proxies=1)
    try:
        pid = s.proxies[0].popen.pid

        def rss_mb():
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
            return 0.0

        rss_before = rss_mb()
        groups = []
        async with httpx.AsyncClient(base_url=s.gateway_url, timeout=120) as http:
            for _ in range(20):
                r = await http.post(
                    "/rl/start_session",
                    json={"task_id": "scale", "group_size": 50},
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                )
                assert r.status_code == 201, r.text
                groups.append(r.json())
            sem = asyncio.Semaphore(32)

            async def session(sess):
                msgs = [{"role": "user", "content": "hi"}]
                for _ in range(3):
                    async with sem:
                        r = await http.post(
                            "/v1/chat/completions",
                            json={"model": MODEL, "messages": msgs, "max_tokens": 1},
                            headers={"Authorization": f"Bearer {sess['session_api_key']}"},
                        )
                    assert r.status_code == 200, r.text
                    msgs = [
                        *msgs,
                        r.json()["choices"][0]["message"],
                        {"role": "user", "content": "more"},
                    ]

            t0 = time.monotonic()
            await asyncio.gather(*(session(x) for g in groups for x in g["sessions"]))
            took = time.monotonic() - t0
            rss_after = rss_mb()
            total = 0
            for g in groups:
                r = await http.post(
                    "/rl/export_trajectories",
                    json={"group_id": g["group_id"], "remove_session": True},
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                )
                rows = r.json()["rows"]
                a = await http.post(
                    "/rl/ack_export",
                    json={"export_id": r.json()["export_id"]},
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                )
                assert len(a.json()["removed"]) == 50, a.text
                # One row per session (the default style): its three turns, each continuing the
                # exact ids of the one before, are one chain.
                assert len(rows) == 50 and {len(rw["interaction_ids"]) for rw in rows} == {3}
                assert {rw["chain_reason"] for rw in rows} == {"root"}
                total += sum(len(rw["interaction_ids"]) for rw in rows)
        assert total == 3000
        # Removed with their groups, the sessions hold no pin on the router any more.
        assert pinned(s) == 0
        print(
            f"\n1000 sessions x 3 turns in {took:.1f}s; proxy RSS {rss_before:.0f} MB -> {rss_after:.0f} MB"
        )
        assert rss_after < rss_before + 150, (rss_before, rss_after)
    finally:
        s.stop()
