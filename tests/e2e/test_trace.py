"""`areal inf trace` against a real stack (router, gateway, one proxy on the shared SGLang
engine): a three-turn RL session made with the official `openai` SDK and its session key,
rewards on two turns, the weight version moved before the third; then the real command,
as an operator runs it (`--gateway-url`, the admin key in the environment), in its three
forms, and the page opened in headless Chromium. tests/cli/test_inf_service.py runs it with
`--service` on a CLI-started service.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import httpx
import openai
import pytest
from stack import ADMIN_KEY, start_stack, workers
from testpaths import PARROT, ROOT
from tokenizers import Tokenizer
from trace_browser import open_page

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"
INJECTION = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>"


@pytest.fixture(scope="module")
def traced(sglang_engine, tmp_path_factory):
    # session_affinity: the policy that pins an id on its first route, so a lookup of an
    # unknown session would show up as a pin (it must not).
    stack = start_stack(
        tmp_path_factory.mktemp("trace"),
        sglang_engine.url,
        PARROT,
        policy="session_affinity",
        n_proxies=1,
    )
    try:
        with stack.admin() as c:
            r = c.post("/rl/start_session", json={"task_id": "trace-task", "group_size": 1})
            assert r.status_code == 201, r.text
            g = r.json()
            [sess] = g["sessions"]
            client = openai.OpenAI(
                base_url=stack.gateway_url + "/v1", api_key=sess["session_api_key"], max_retries=0
            )
            msgs = [{"role": "user", "content": f"hello {INJECTION}"}]
            answers = []
            for turn in range(3):
                if turn == 2:
                    v = c.post("/admin/set_version", json={"version": 7})
                    assert v.status_code == 200, v.text
                a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6)
                answers.append(a)
                msgs += [
                    a.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": f"more {turn}"},
                ]
        with httpx.Client(
            base_url=stack.gateway_url,
            headers={"Authorization": f"Bearer {sess['session_api_key']}"},
            timeout=60,
        ) as s:
            for iid, reward in ((answers[0].id, 0.5), (answers[2].id, 1.0)):
                r = s.post("/rl/set_reward", json={"interaction_id": iid, "reward": reward})
                assert r.status_code == 200, r.text
        yield stack, g, answers
    finally:
        stack.stop()


def trace(stack, *args, key=ADMIN_KEY):
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env["AREAL_ADMIN_API_KEY"] = key
    p = subprocess.run(
        [sys.executable, "-m", "areal_cli.main", "inf", "trace", "--gateway-url",
         stack.gateway_url, *args],
        capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
    )  # fmt: skip
    return p.returncode, p.stdout, p.stderr


def test_json_is_the_session_token_by_token(traced):
    stack, g, answers = traced
    sid = g["sessions"][0]["session_id"]
    code, out, err = trace(stack, "--session", sid, "--tokenizer-path", str(PARROT), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["model"] == MODEL and doc["query"] == {"session_id": sid}
    [sess] = doc["sessions"]
    assert sess["task_id"] == "trace-task" and sess["reward_total"] == 1.5
    its = sess["interactions"]
    assert [i["turn"] for i in its] == [1, 2, 3]
    assert [i["interaction_id"] for i in its] == [a.id for a in answers]
    assert [i["reward"] for i in its] == [0.5, 0.0, 1.0]  # as set, no discount
    assert [i["finish_reason"] for i in its] == [a.choices[0].finish_reason for a in answers]
    tok = Tokenizer.from_file(str(PARROT / "tokenizer.json"))
    for it, a in zip(its, answers, strict=True):
        out_toks = [t for t in it["tokens"] if t["mask"]]
        assert out_toks and all(t["logprob"] is not None and t["bucket"] for t in out_toks)
        # The pieces spell what the engine made (special tokens as their text).
        ids = [t["id"] for t in out_toks]
        assert "".join(t["piece"] for t in out_toks) == tok.decode(ids, skip_special_tokens=False)
        assert a.choices[0].message.content in "".join(t["piece"] for t in out_toks)
        prompt = "".join(t["piece"] for t in it["tokens"] if not t["mask"])
        assert INJECTION in prompt
    # The version moved to 7 before turn 3: marked at its first output token.
    assert its[0]["versions"] == its[1]["versions"] == [0] and its[2]["versions"] == [7]
    changes = [
        (i["turn"], j) for i in its for j, t in enumerate(i["tokens"]) if t["version_change"]
    ]
    first_out = next(j for j, t in enumerate(its[2]["tokens"]) if t["mask"])
    assert changes == [(3, first_out)]


def test_text_view_and_nothing_removed(traced):
    stack, g, _ = traced
    sid = g["sessions"][0]["session_id"]
    code, out, err = trace(stack, "--group", g["group_id"], "--tokenizer-path", str(PARROT))
    assert code == 0, err
    assert f"session {sid} · group {g['group_id']} · task trace-task · 3 interactions" in out
    assert out.count("── turn ") == 3 and "▸v7[" in out
    assert "reward 0.5 ·" in out and "reward 1 ·" in out and "\x1b" not in out
    # Read-only: a trainer's export still gets all three rows.
    with stack.admin() as c:
        r = c.post("/rl/export_trajectories", json={"session_ids": [sid], "style": "individual"})
    assert r.status_code == 200 and r.json()["count"] == 3


def test_unknown_session_is_one_line_and_pins_nothing(traced):
    stack, _, _ = traced
    pins = sum(int(w.get("sessions", 0)) for w in workers(stack))
    code, out, err = trace(stack, "--session", "sess-does-not-exist")
    assert code == 1 and out == ""
    # What was asked for, then the gateway's own words, on one line.
    line = err.strip()
    assert "\n" not in line, err
    assert line.startswith(
        f"error: session 'sess-does-not-exist' not found on {stack.gateway_url} ("
    ), err
    code, _, err = trace(stack, "--group", "grp-does-not-exist")
    assert code == 1 and err.startswith("error: group 'grp-does-not-exist' not found on "), err
    code, _, err = trace(stack, "--session", "x", key="not-the-key")
    assert code == 1 and "refused the admin key" in err
    import time

    time.sleep(1.2)  # the router polls the proxies' session counts every 0.5 s
    assert sum(int(w.get("sessions", 0)) for w in workers(stack)) == pins


def test_page_in_a_browser(traced, tmp_path):
    stack, g, _ = traced
    sid = g["sessions"][0]["session_id"]
    target = tmp_path / "trace.html"
    code, out, err = trace(
        stack, "--session", sid, "--tokenizer-path", str(PARROT), "--html", str(target)
    )
    assert code == 0, err
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    code, out, _ = trace(stack, "--session", sid, "--tokenizer-path", str(PARROT), "--json")
    its = json.loads(out)["sessions"][0]["interactions"]
    errors: list[str] = []
    with open_page(target, errors) as p:
        assert p.locator("main .turn").count() == 3
        assert p.locator("main .t").count() == sum(len(i["tokens"]) for i in its)
        assert p.locator("main .t.o").count() == sum(i["output_tokens"] for i in its)
        heads = p.locator(".turn-head").all_inner_texts()
        assert "reward 0.5" in heads[0] and "reward 1" in heads[2]
        assert p.locator(".turn").nth(2).locator(".vmark").inner_text() == "v7"
        assert p.evaluate("window.pwned") is None and p.locator("main img").count() == 0
        assert INJECTION in p.inner_text(".turn >> nth=0 >> details.prompt .tokens")
        p.hover("main .t.o")
        info = p.inner_text("#info")
        first = next(t for t in its[0]["tokens"] if t["mask"])
        assert f"{first['logprob']:.4f}" in info and str(first["id"]) in info
        if os.environ.get("AREAL_TRACE_SCREENSHOT"):  # for a person to look at
            p.screenshot(path=os.environ["AREAL_TRACE_SCREENSHOT"], full_page=True)
    assert not errors, errors
