"""The `areal inf trace --html` page in a real browser (headless Chromium): what a reader
sees, from fixture rows made with the parrot's tokenizer. tests/e2e/test_trace.py opens a
page of a real session."""

from __future__ import annotations

import math

import pytest
from testpaths import PARROT
from tokenizers import Tokenizer
from trace_browser import open_page, require_chromium

from areal_cli.inf.trace import build
from areal_cli.inf.trace_html import page
from areal_cli.inf.trace_pieces import Pieces

INJECTION = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    require_chromium()
    tok = Tokenizer.from_file(str(PARROT / "tokenizer.json"))

    def row(iid, prompt, out, lps, vers, reward, finish):
        p, o = tok.encode(prompt).ids, tok.encode(out).ids
        assert len(o) == len(lps) == len(vers)
        return {
            "input_ids": [whole, *p[1:], *o] if iid.endswith("1") else p + o,
            "loss_mask": [0] * len(p) + [1] * len(o),
            "logprobs": [0.0] * len(p) + lps,
            "versions": [-1] * len(p) + vers,
            "reward": reward,
            "session_id": "sess-1",
            "group_id": "grp-1",
            "task_id": "task-1",
            "interaction_id": iid,
            "interaction_ids": [iid],
            "response_id": iid,
            "choice_index": 0,
            "replicas": [[len(p), "tiny-data-proxy-0"]],
            "finish_reason": finish,
        }

    # The markup also as one token, so the browser sees it whole in one element: split over
    # several token elements it could not run even unescaped.
    pieces = Pieces.from_dir(PARROT)
    whole = max(pieces.vocab) + 1
    pieces.vocab[whole] = INJECTION
    pieces.special = pieces.special | {whole}
    rows = [
        row("chatcmpl-1", f"user: {INJECTION}\n", "ab", [-0.01, -6.0], [3, 3], 0.0, "stop"),
        row("chatcmpl-2", "user: more\n", "cd", [-0.5, -2.0], [3, 4], 1.5, "length"),
    ]
    doc = build(
        rows,
        model="tiny",
        pieces=pieces,
        query={"session_id": "sess-1"},
        source={"service": "default", "gateway_url": "http://127.0.0.1:8080"},
        tokenizer={"path": str(PARROT), "decoded": True},
    )
    path = tmp_path_factory.mktemp("page") / "trace.html"
    path.write_text(page(doc))
    return path, doc


def test_page_shows_turns_tokens_colours_and_rewards(written):
    path, doc = written
    tokens = [t for s in doc["sessions"] for i in s["interactions"] for t in i["tokens"]]
    errors: list[str] = []
    with open_page(path, errors) as p:
        assert p.locator("main .turn").count() == 2
        assert p.locator("main .t").count() == len(tokens)
        assert p.locator("main .t.o").count() == sum(t["mask"] for t in tokens)

        def bg(selector):
            return p.eval_on_selector(selector, "e => getComputedStyle(e).backgroundColor")

        high, very_low = bg("main .t.o.b-high"), bg("main .t.o.b-very_low")
        assert high != very_low, high
        assert bg("main .t.p") not in (high, very_low)
        heads = p.locator(".turn-head").all_inner_texts()
        assert "reward 0" in heads[0] and "finish: stop" in heads[0]
        assert "reward 1.5" in heads[1] and "finish: length" in heads[1]
        assert "reward total 1.5" in p.inner_text(".session h2")
        # The version moves from 3 to 4 at turn 2's second output token.
        assert p.locator(".turn").nth(1).locator(".vmark").inner_text() == "v4"

        # Hover: the token's id, logprob and version, as text.
        p.hover("main .t.o.b-very_low")
        info = p.inner_text("#info")
        lp = next(t["logprob"] for t in tokens if t["bucket"] == "very_low")
        assert f"{lp:.4f}" in info and "version" in info and "3" in info
        assert f"{math.exp(lp) * 100:.1f}%" in info
        p.click("main .t.p")  # pinned: a prompt token says it is masked
        assert "0: prompt, not trained" in p.inner_text("#info")
        p.mouse.move(5, 5)
        assert "0: prompt, not trained" in p.inner_text("#info")
    assert not errors, errors


def test_injected_markup_in_a_prompt_is_text(written):
    path, _ = written
    errors: list[str] = []
    with open_page(path, errors) as p:
        assert p.evaluate("window.pwned") is None
        assert p.locator("main img").count() == 0 and p.locator("main script").count() == 0
        first = p.locator(".turn").first.locator("details.prompt .t")
        assert first.first.inner_text() == INJECTION  # the one-token markup, as text
        prompt_text = p.inner_text(".turn >> nth=0 >> details.prompt .tokens")
        assert INJECTION in prompt_text  # and spelt over many tokens
    # A CSP refusal would be a console error: nothing was even tried.
    assert not errors, errors
