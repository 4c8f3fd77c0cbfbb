"""`areal inf trace`: pieces, the trace document, the terminal view, the page, and the
command against a stand-in gateway (stdlib HTTP server) with fixture rows."""

from __future__ import annotations

import json
import os
import pty
import re
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from areal_cli.inf.trace import bucket, build, shown
from areal_cli.inf.trace_html import page
from areal_cli.inf.trace_pieces import Pieces
from areal_cli.inf.trace_text import render

KEY = "test-admin-key"
INJECTION = "<script>window.pwned=1</script><img src=x onerror=alert(1)>"


def _tokenizer_dir(tmp_path: Path) -> Path:
    """A byte-level BPE tokenizer.json: one character per token, plus two special tokens."""
    from areal_cli.inf.trace_pieces import _BYTE_LEVEL

    to_char = {b: c for c, b in _BYTE_LEVEL.items()}
    vocab = {to_char[b]: b for b in range(256)}
    vocab["Ġthe"] = 256
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(
        json.dumps(
            {
                "model": {"type": "BPE", "vocab": vocab},
                "added_tokens": [
                    {"id": 300, "content": "<|im_start|>", "special": True},
                    {"id": 301, "content": "<|im_end|>", "special": True},
                    # Markup as one token: split over several token elements it could not
                    # run even unescaped, so the page's escaping is tested on this one.
                    {"id": 302, "content": INJECTION, "special": True},
                ],
                "decoder": {"type": "ByteLevel"},
            }
        )
    )
    return d


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _row(sid, iid, prompt, out, lps, vers, reward, finish="stop", response=None, choice=0, pre=()):
    p = [300, *pre, *_ids(prompt), 301]
    o = out
    return {
        "input_ids": p + o,
        "loss_mask": [0] * len(p) + [1] * len(o),
        "logprobs": [0.0] * len(p) + lps,
        "versions": [-1] * len(p) + vers,
        "reward": reward,
        "session_id": sid,
        "group_id": "g1",
        "task_id": "task-a",
        "interaction_id": iid,
        "interaction_ids": [iid],
        "response_id": response or iid,
        "choice_index": choice,
        "replicas": [[len(p), "proxy-0"]],
        "finish_reason": finish,
    }


def _rows() -> list[dict]:
    return [
        # Turn 1: four output tokens, all buckets, version 3 then 4 mid-turn.
        _row(
            "s1",
            "c-1",
            "hi " + INJECTION,
            [256, *_ids("ok"), 301],
            [-0.01, -0.5, -2.0, -7.5],
            [3, 3, 4, 4],
            0.0,
            pre=[302],
        ),
        # Turn 2: the version moves on again at its first token (5 after 4).
        _row("s1", "c-2", "more\x1b[2J", [*_ids("\nz")], [-0.05, -0.2], [5, 5], 1.5, "length"),
    ]


def _doc(pieces=None, rows=None) -> dict:
    return build(
        rows if rows is not None else _rows(),
        model="tiny",
        pieces=pieces,
        query={"session_id": "s1"},
        source={"service": None, "gateway_url": "http://127.0.0.1:1"},
        tokenizer={"path": None, "decoded": pieces is not None},
    )


# --------------------------------------------------------------------------- pieces


def test_pieces_byte_level_special_and_partial_utf8(tmp_path):
    p = Pieces.from_dir(_tokenizer_dir(tmp_path))
    assert p.piece(256) == " the"  # Ġ is a space
    assert p.piece(ord("\n")) == "\n"
    assert p.piece(300) == "<|im_start|>"
    assert p.piece(0xE2) == "\\xe2"  # the first byte of a 3-byte character alone
    assert p.piece(99999) is None


def test_pieces_sentencepiece_byte_fallback(tmp_path):
    d = tmp_path / "sp"
    d.mkdir()
    (d / "tokenizer.json").write_text(
        json.dumps(
            {
                "model": {"type": "BPE", "vocab": {"▁Hello": 5, "<0x0A>": 6, "x": 7}},
                "decoder": {
                    "type": "Sequence",
                    "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}],
                },
            }
        )
    )
    p = Pieces.from_dir(d)
    assert [p.piece(i) for i in (5, 6, 7)] == [" Hello", "\n", "x"]


def test_pieces_missing_tokenizer_is_a_clear_error(tmp_path):
    from areal_cli.errors import CLIError

    with pytest.raises(CLIError, match=r"no tokenizer\.json in .*--tokenizer-path"):
        Pieces.from_dir(tmp_path)


# --------------------------------------------------------------------------- document


def test_buckets_bounds():
    assert [bucket(x) for x in (0.0, -0.1, -0.11, -1.0, -2.9, -3.0, -3.01, -50)] == [
        "high", "high", "mid", "mid", "low", "low", "very_low", "very_low",
    ]  # fmt: skip


def test_document_mask_logprobs_versions_rewards(tmp_path):
    doc = _doc(Pieces.from_dir(_tokenizer_dir(tmp_path)))
    [sess] = doc["sessions"]
    assert sess["reward_total"] == 1.5
    t1, t2 = sess["interactions"]
    assert (t1["turn"], t2["turn"]) == (1, 2)
    assert (t1["finish_reason"], t2["finish_reason"]) == ("stop", "length")
    assert (t1["reward"], t2["reward"]) == (0.0, 1.5)
    prompt = [t for t in t1["tokens"] if not t["mask"]]
    out = [t for t in t1["tokens"] if t["mask"]]
    assert all(t["logprob"] is None and t["version"] is None for t in prompt)
    assert "".join(t["piece"] for t in prompt) == f"<|im_start|>{INJECTION}hi {INJECTION}<|im_end|>"
    assert [t["piece"] for t in out] == [" the", "o", "k", "<|im_end|>"]
    assert [t["bucket"] for t in out] == ["high", "mid", "low", "very_low"]
    assert [t["version_change"] for t in out] == [False, False, True, False]
    assert t1["versions"] == [3, 4] and t1["output_tokens"] == 4
    assert t1["prompt_tokens"] == len(prompt)
    # Across turns of a session: 4 -> 5 at turn 2's first token.
    assert [t["version_change"] for t in t2["tokens"] if t["mask"]] == [True, False]


def test_choices_of_one_request_share_a_turn():
    rows = [
        _row("s1", "r-0", "q", [65], [-0.1], [0], 1.0, response="r", choice=0),
        _row("s1", "r-1", "q", [66], [-0.1], [0], 0.0, response="r", choice=1),
        _row("s1", "r2", "q2", [67], [-0.1], [0], 0.0),
    ]
    turns = [(i["turn"], i["choice_index"]) for i in _doc(rows=rows)["sessions"][0]["interactions"]]
    assert turns == [(1, 0), (1, 1), (2, 0)]


def test_json_keys_are_the_documented_ones():
    doc = _doc()
    assert set(doc) == {"source", "model", "query", "tokenizer", "logprob_buckets", "sessions"}
    assert doc["logprob_buckets"][0] == {"name": "high", "min": -0.1}
    [sess] = doc["sessions"]
    assert set(sess) == {"session_id", "group_id", "task_id", "reward_total", "interactions"}
    it = sess["interactions"][0]
    assert set(it) == {
        "turn", "interaction_id", "response_id", "choice_index", "finish_reason", "reward",
        "replicas", "versions", "prompt_tokens", "output_tokens", "mean_logprob", "tokens",
    }  # fmt: skip
    assert set(it["tokens"][0]) == {
        "id", "piece", "mask", "logprob", "version", "bucket", "version_change",
    }  # fmt: skip
    # Without a tokenizer the pieces are null and shown as the ids.
    assert it["tokens"][0]["piece"] is None and shown(it["tokens"][0]) == "⟨300⟩"
    docs = (Path(__file__).resolve().parents[3] / "docs/cli.md").read_text()
    for key in ("logprob_buckets", "reward_total", "mean_logprob", "version_change", "bucket"):
        assert f"`{key}`" in docs, key


# --------------------------------------------------------------------------- terminal view


def test_plain_view(tmp_path):
    text = render(_doc(Pieces.from_dir(_tokenizer_dir(tmp_path))), color=False)
    assert "\x1b" not in text  # no colour, and the prompt's ESC is shown, not sent
    assert "more\\x1b[2J" in text
    assert "finish stop · reward 0 · version 3,4" in text
    assert "finish length · reward 1.5 · version 5" in text
    assert "[ the -0.01][o -0.50]▸v4[k -2.00][<|im_end|> -7.50]" in text
    assert "▸v5[↵ -0.05]\n" in text  # a newline piece: `↵` in its cell, then the line breaks
    assert "prompt (" in text and "masked" in text
    assert "reward total 1.5" in text


def test_colour_view_shades_buckets(tmp_path):
    text = render(_doc(Pieces.from_dir(_tokenizer_dir(tmp_path))), color=True)
    out_line = next(line for line in text.splitlines() if " the" in line and "k" in line)

    def bg(piece):
        m = re.search(r"\x1b\[48;5;(\d+);38;5;255m" + re.escape(piece) + r"\x1b\[0m", out_line)
        assert m, (piece, out_line)
        return int(m.group(1))

    shades = [bg(" the"), bg("o"), bg("k"), bg("<|im_end|>")]
    assert len(set(shades)) == 4  # one colour per bucket here
    assert "▸v4" in out_line
    # The only ESC bytes are our colour codes: the prompt's ESC is shown as \x1b.
    assert "\x1b[2J" not in text and "more\\x1b[2J" in re.sub(r"\x1b\[[0-9;]*m", "", text)


# --------------------------------------------------------------------------- page


def test_page_escapes_prompt_text_and_is_self_contained(tmp_path):
    html = page(_doc(Pieces.from_dir(_tokenizer_dir(tmp_path))))
    assert INJECTION[:8] not in html.replace("<script nonce=", "")
    assert "&lt;script&gt;window.pwned=1&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in (
        re.sub(r"<[^>]+>", "", html)
    )
    assert html.count("<script") == 1  # the page's own script only
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing fetched
    assert 'class="t o b-very_low' in html and 'class="t o b-high' in html
    assert '<span class="vmark">v4</span>' in html
    assert "reward 1.5" in html and "finish: length" in html


# --------------------------------------------------------------------------- the command


class FakeGateway:
    """/rl/sessions/{id} and /rl/export_trajectories over fixture rows; records requests."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        self.requests: list[tuple[str, str, dict | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status, doc):
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _auth(self):
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    self._send(401, {"error": {"message": "Invalid API key."}})
                    return False
                return True

            def do_GET(self):
                outer.requests.append(("GET", self.path, None))
                if not self._auth():
                    return
                sid = self.path.rsplit("/", 1)[1]
                if any(r["session_id"] == sid for r in outer.rows):
                    self._send(200, {"session_id": sid, "model": "tiny"})
                else:
                    self._send(404, {"error": {"message": f"session '{sid}' not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(("POST", self.path, body))
                if not self._auth():
                    return
                gid = body.get("group_id")
                if gid and gid != "g1":
                    self._send(404, {"error": {"message": f"group '{gid}' not found"}})
                    return
                rows = outer.rows if gid else [
                    r for r in outer.rows if r["session_id"] in body["session_ids"]
                ]  # fmt: skip
                self._send(200, {"count": len(rows), "rows": rows})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway():
    rows = [*_rows(), _row("s2", "c-3", "other", [*_ids("yo")], [-0.3, -0.4], [5, 5], -1.0)]
    g = FakeGateway(rows)
    yield g
    g.close()


def _base_env(home) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    return {**env, "AREAL_HOME": str(home), "AREAL_ADMIN_API_KEY": KEY}


def _cli(home, *args, env=None):
    e = {**_base_env(home), **(env or {})}
    p = subprocess.run(
        [sys.executable, "-m", "areal_cli.main", "inf", "trace", *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=60,
    )
    return p.returncode, p.stdout, p.stderr


def test_session_text_json_and_read_only(home, gateway, tmp_path):
    tok = _tokenizer_dir(tmp_path)
    args = ("--gateway-url", gateway.url, "--session", "s1", "--tokenizer-path", str(tok))
    code, out, err = _cli(home, *args)
    assert code == 0, err
    assert "session s1 · group g1 · task task-a · 2 interactions · reward total 1.5" in out
    assert "[ the -0.01]" in out and "\x1b" not in out  # not a terminal: plain
    code, out, err = _cli(home, *args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [s["session_id"] for s in doc["sessions"]] == ["s1"]
    assert doc["model"] == "tiny" and doc["tokenizer"] == {"path": str(tok), "decoded": True}
    exports = [b for m, p, b in gateway.requests if p == "/rl/export_trajectories"]
    # Read-only: never asks for removal; rewards as set (no discount).
    assert exports and all(
        not b.get("remove_session") and b["discount"] == 0.0 and b["style"] == "individual"
        for b in exports
    )


def test_group_has_each_session(home, gateway):
    code, out, err = _cli(home, "--gateway-url", gateway.url, "--group", "g1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [s["session_id"] for s in doc["sessions"]] == ["s1", "s2"]
    assert doc["query"] == {"group_id": "g1"}
    assert "tokens shown as ids" in err  # no tokenizer: a warning, the ids as pieces


def test_colour_only_on_a_terminal_without_no_color(home, gateway, tmp_path):
    tok = _tokenizer_dir(tmp_path)

    def on_tty(extra_env):
        master, slave = pty.openpty()
        env = {**_base_env(home), **extra_env}
        p = subprocess.Popen(
            [sys.executable, "-m", "areal_cli.main", "inf", "trace", "--gateway-url",
             gateway.url, "--session", "s1", "--tokenizer-path", str(tok)],
            stdout=slave, stderr=subprocess.PIPE, env=env,
        )  # fmt: skip
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        p.wait(timeout=30)
        os.close(master)
        return b"".join(chunks).decode()

    assert "\x1b[48;5;" in on_tty({})
    plain = on_tty({"NO_COLOR": "1"})
    assert "[ the -0.01]" in plain and "\x1b[48;5;" not in plain


def test_html_file_is_private_and_escaped(home, gateway, tmp_path):
    target = tmp_path / "trace.html"
    code, out, err = _cli(
        home, "--gateway-url", gateway.url, "--session", "s1", "--html", str(target)
    )
    assert code == 0, err
    assert out == "" and f"wrote {target}" in err
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert "<script>window.pwned" not in target.read_text()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("--session", "nope"), 1, "error: session 'nope' not found on http://127.0.0.1:"),
        (("--group", "g9"), 1, "error: group 'g9' not found on http://127.0.0.1:"),
        (("--session", "s1", "--group", "g1"), 2, "exactly one of --session or --group"),
        ((), 2, "exactly one of --session or --group"),
        (("--session", "s1", "--html", "/nonexistent-dir/x.html"), 2, "does not exist"),
        (("--session", "s1", "--service", "x"), 2, "--service or --gateway-url, not both"),
    ],
)
def test_errors_are_one_line_with_exit_codes(home, gateway, args, code, message):
    rc, out, err = _cli(home, "--gateway-url", gateway.url, *args)
    assert rc == code, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_wrong_key_and_unknown_service(home, gateway):
    rc, _, err = _cli(home, "--gateway-url", gateway.url, "--session", "s1",
                      env={"AREAL_ADMIN_API_KEY": "wrong"})  # fmt: skip
    assert rc == 1 and "refused the admin key" in err
    rc, _, err = _cli(home, "--service", "ghost", "--session", "s1")
    assert rc == 1 and "no inf service named 'ghost'" in err
    rc, _, err = _cli(home, "--service", "", "--session", "s1")
    assert rc == 2
    rc, _, err = _cli(home, "--gateway-url", gateway.url, "--session", "s1",
                      env={"AREAL_ADMIN_API_KEY": ""})  # fmt: skip
    assert rc == 2 and "admin key" in err
