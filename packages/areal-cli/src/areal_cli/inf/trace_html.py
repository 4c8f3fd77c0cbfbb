"""`areal inf trace --html FILE`: the trace document (trace.py) as one self-contained page.

Inline CSS and JS, nothing fetched: it opens offline from the file. Prompts and outputs are
untrusted text, so every string is HTML-escaped where it is written, and a Content Security
Policy allows only this page's own style and script (by a per-page nonce): markup that got
through unescaped still could not run. Token details live in data attributes; the script
shows them with textContent, never as markup.
"""

from __future__ import annotations

import math
import secrets
from html import escape
from typing import Any

from areal_cli.inf.trace import fmt_mean, fmt_reward, shown
from areal_cli.inf.trace_text import LABELS

_CSS = """
:root { --ink:#1f2328; --muted:#656d76; --line:#d0d7de; --bg:#f6f8fa; --card:#fff; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif; color:var(--ink);
  background:var(--bg); }
header { position:sticky; top:0; z-index:2; background:var(--card);
  border-bottom:1px solid var(--line); padding:12px 24px; }
h1 { font-size:18px; margin:0 0 4px; }
h1 .what { font-weight:400; color:var(--muted); }
.meta { color:var(--muted); font-size:13px; }
.legend { margin-top:8px; display:flex; flex-wrap:wrap; gap:6px 14px; align-items:center;
  font-size:13px; }
main { padding:16px 24px 120px; max-width:1200px; }
code, .tokens { font-family:ui-monospace,"SFMono-Regular",Menlo,Consolas,monospace; }
.session { margin-bottom:28px; }
.session h2 { font-size:15px; margin:8px 0 10px; display:flex; flex-wrap:wrap; gap:8px;
  align-items:center; }
.turn { background:var(--card); border:1px solid var(--line); border-radius:8px;
  margin-bottom:14px; overflow:hidden; }
.turn-head { display:flex; flex-wrap:wrap; gap:6px 8px; align-items:center; padding:8px 12px;
  background:#eef1f4; border-bottom:1px solid var(--line); }
.turn-no { font-weight:600; margin-right:4px; }
.pill { display:inline-block; padding:1px 8px; border-radius:10px; background:#fff;
  border:1px solid var(--line); font-size:12px; color:var(--ink); }
.pill.reward { background:#ddf4ff; border-color:#54aeff; font-weight:600; }
.pill.reward.neg { background:#ffebe9; border-color:#ff8182; }
.pill.finish-stop { background:#dafbe1; border-color:#4ac26b; }
.pill.finish-length { background:#fff8c5; border-color:#d4a72c; }
.pill.finish-other { background:#fbefff; border-color:#c297ff; }
.iid { color:var(--muted); font-size:12px; margin-left:auto; }
details.prompt { border-bottom:1px dashed var(--line); }
summary, .label { cursor:pointer; padding:6px 12px; color:var(--muted); font-size:12px;
  text-transform:uppercase; letter-spacing:.04em; }
.label { cursor:default; }
.tokens { white-space:pre-wrap; word-break:break-word; padding:4px 12px 10px;
  font-size:13px; line-height:1.75; }
.t { border-radius:3px; padding:1px 0; cursor:pointer; box-shadow:inset -1px 0 0 rgba(255,255,255,.9); }
.p { color:#57606a; background:#f0f2f4; }
.p.a { background:#e4e7eb; }
.b-high { background:#c9f0d3; } .b-high.a { background:#b2e7c0; }
.b-mid { background:#fff1a8; } .b-mid.a { background:#ffe680; }
.b-low { background:#ffcf9e; } .b-low.a { background:#ffbd7a; }
.b-very_low { background:#ff9e9e; } .b-very_low.a { background:#ff8585; }
.t:hover, .t.sel { outline:2px solid #0969da; }
.vmark { display:inline-block; background:#8250df; color:#fff; border-radius:3px;
  font-size:11px; padding:0 4px; margin:0 2px; font-family:system-ui,sans-serif; }
.swatch { padding:1px 6px; border-radius:3px; }
.empty { color:var(--muted); }
#info { position:fixed; right:16px; bottom:16px; z-index:3; min-width:260px; max-width:420px;
  background:#1f2328; color:#f6f8fa; border-radius:8px; padding:10px 14px; font-size:13px;
  box-shadow:0 4px 16px rgba(0,0,0,.25); }
#info .k { color:#9198a1; display:inline-block; min-width:72px; }
#info .piece { font-family:ui-monospace,Menlo,Consolas,monospace; background:#3d444d;
  padding:0 4px; border-radius:3px; white-space:pre-wrap; }
#info .hint { color:#9198a1; }
"""

# Shows a token's details (from its data attributes, as text) on hover; a click pins them
# until another click or Escape.
_JS = """
(function () {
  var info = document.getElementById('info');
  var pinned = null;
  function row(k, v, cls) {
    var d = document.createElement('div');
    var s = document.createElement('span'); s.className = 'k'; s.textContent = k;
    var t = document.createElement('span'); if (cls) t.className = cls; t.textContent = v;
    d.appendChild(s); d.appendChild(t); return d;
  }
  function show(el) {
    info.replaceChildren();
    var d = el.dataset;
    info.appendChild(row('token', '#' + d.i + ' of turn ' + d.turn));
    info.appendChild(row('piece', el.textContent, 'piece'));
    info.appendChild(row('id', d.id));
    if (d.lp !== undefined) {
      var lp = Number(d.lp);
      info.appendChild(row('logprob', lp.toFixed(4) + '  (p = ' + (Math.exp(lp) * 100).toFixed(1) + '%)'));
      info.appendChild(row('version', d.v));
      info.appendChild(row('mask', '1: output, trained'));
    } else {
      info.appendChild(row('mask', '0: prompt, not trained'));
    }
    if (pinned) info.appendChild(row('', 'pinned: click again or Esc', 'hint'));
  }
  document.addEventListener('mouseover', function (e) {
    var el = e.target.closest && e.target.closest('.t');
    if (el && !pinned) show(el);
  });
  document.addEventListener('click', function (e) {
    var el = e.target.closest && e.target.closest('.t');
    if (pinned) pinned.classList.remove('sel');
    if (!el || el === pinned) { pinned = null; return; }
    pinned = el; el.classList.add('sel'); show(el);
  });
  document.addEventListener('keydown', function (e) {
    if (e.key === 'Escape' && pinned) { pinned.classList.remove('sel'); pinned = null; }
  });
})();
"""


def page(doc: dict[str, Any]) -> str:
    nonce = secrets.token_urlsafe(16)
    q = doc["query"]
    what = f"session {q['session_id']}" if "session_id" in q else f"group {q['group_id']}"
    src = doc["source"]
    where = f"inf service {src['service']}" if src.get("service") else "gateway"
    tok = doc["tokenizer"]
    pieces = (
        "decoded from " + str(tok["path"]) if tok.get("decoded") else "token ids (no tokenizer)"
    )
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        f"style-src 'nonce-{nonce}'; script-src 'nonce-{nonce}'\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>areal trace · {escape(what)}</title>",
        f'<style nonce="{nonce}">{_CSS}</style></head><body>',
        "<header>",
        f'<h1>areal trace <span class="what">{escape(what)}</span></h1>',
        f'<div class="meta">model <code>{escape(doc["model"] or "?")}</code> · {escape(where)} '
        f"<code>{escape(src['gateway_url'])}</code> · pieces {escape(pieces)}</div>",
        _legend(),
        "</header><main>",
    ]
    if not doc["sessions"]:
        parts.append(f'<p class="empty">No interactions recorded for {escape(what)}.</p>')
    for si, sess in enumerate(doc["sessions"]):
        parts.append(_session(sess, si))
    parts.append(
        '</main><aside id="info"><span class="hint">Hover or click a token.</span></aside>'
    )
    parts.append(f'<script nonce="{nonce}">{_JS}</script></body></html>\n')
    return "\n".join(parts)


def _legend() -> str:
    cells = "".join(
        f'<span class="swatch b-{escape(b)}">{escape(label)}</span>' for b, label in LABELS.items()
    )
    return (
        f'<div class="legend"><span>logprob</span>{cells}'
        '<span class="swatch p">prompt · masked, not trained</span>'
        '<span><span class="vmark">v2</span> weight version changes here</span></div>'
    )


def _session(sess: dict[str, Any], si: int) -> str:
    n = len(sess["interactions"])
    out = [
        f'<section class="session" id="s{si}"><h2>session <code>{escape(sess["session_id"])}'
        f'</code><span class="pill">group {escape(str(sess["group_id"]))}</span>'
        f'<span class="pill">task {escape(str(sess["task_id"]))}</span>'
        f'<span class="pill">{n} interaction{"s" if n != 1 else ""}</span>'
        f"{_reward(sess['reward_total'], 'reward total')}</h2>"
    ]
    out.extend(_turn(it) for it in sess["interactions"])
    out.append("</section>")
    return "\n".join(out)


def _reward(r: float, label: str) -> str:
    neg = " neg" if r < 0 else ""
    return f'<span class="pill reward{neg}">{escape(label)} {escape(fmt_reward(r))}</span>'


def _turn(it: dict[str, Any]) -> str:
    finish = str(it["finish_reason"] or "-")
    fcls = f"finish-{finish}" if finish in ("stop", "length") else "finish-other"
    versions = ", ".join(str(v) for v in it["versions"]) or "-"
    mean = it["mean_logprob"]
    turn = f"turn {it['turn']}" + (f" · choice {it['choice_index']}" if it["choice_index"] else "")
    head = (
        f'<div class="turn-head"><span class="turn-no">{escape(turn)}</span>'
        f'<span class="pill {fcls}">finish: {escape(finish)}</span>'
        f"{_reward(it['reward'], 'reward')}"
        f'<span class="pill">version {escape(versions)}</span>'
        f'<span class="pill">{it["prompt_tokens"]} prompt + {it["output_tokens"]} output tokens'
        "</span>"
        f'<span class="pill">mean logprob {"-" if mean is None else fmt_mean(mean)}</span>'
        f'<code class="iid">{escape(str(it["interaction_id"]))}</code></div>'
    )
    prompt: list[str] = []
    output: list[str] = []
    for i, t in enumerate(it["tokens"]):
        (output if t["mask"] else prompt).append(_token(t, i, it["turn"], len(output)))
    return (
        f'<article class="turn" data-turn="{it["turn"]}">{head}'
        f'<details class="prompt" open><summary>prompt · {len(prompt)} tokens · masked, not '
        f'trained</summary><div class="tokens">{"".join(prompt)}</div></details>'
        f'<div class="output"><div class="label">output · {len(output)} tokens · trained</div>'
        f'<div class="tokens">{"".join(output)}</div></div></article>'
    )


def _token(t: dict[str, Any], i: int, turn: int, nth_output: int) -> str:
    text = escape(shown(t))
    common = f'data-i="{i}" data-turn="{turn}" data-id="{escape(str(t["id"]))}"'
    if not t["mask"]:
        alt = " a" if i % 2 else ""
        return f'<span class="t p{alt}" {common} title="id {escape(str(t["id"]))} · prompt">{text}</span>'
    lp = float(t["logprob"])
    lp_text = repr(lp) if math.isfinite(lp) else "-Infinity"
    alt = " a" if nth_output % 2 else ""
    mark = f'<span class="vmark">v{t["version"]}</span>' if t["version_change"] else ""
    return (
        f'{mark}<span class="t o b-{escape(t["bucket"])}{alt}" {common} data-lp="{lp_text}" '
        f'data-v="{escape(str(t["version"]))}" title="id {escape(str(t["id"]))} · logprob '
        f'{lp:.4f} · version {escape(str(t["version"]))}">{text}</span>'
    )
