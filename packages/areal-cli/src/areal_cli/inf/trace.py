"""`areal inf trace`: a session's (or a group's) recorded interactions, token by token.

Where the data comes from: the gateway's RL API, read-only. `GET /rl/sessions/{id}` names
the session's model (and answers 404 for an unknown one); `POST /rl/export_trajectories`
without `remove_session` returns the rows and removes nothing (docs/services.md, "Gateway RL
API"), with `discount` 0 so each row's reward is the one set on that interaction. Token
pieces are decoded here from the model's `tokenizer.json` (trace_pieces.py): the folder the
service's state records for the model, or `--tokenizer-path`; without one, pieces are the ids.

The one data model is the JSON document `build` returns (`--json` prints it; docs/cli.md
lists its keys); the terminal view (trace_text.py) and the page (trace_html.py) render it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from areal_cli import state as st
from areal_cli.errors import CLIError
from areal_cli.http import call, error_message

if TYPE_CHECKING:
    from areal_cli.inf.trace_pieces import Pieces

GROUP = "inf"

# Logprob shading: a generated token falls in the first bucket whose `min` it reaches.
# Bounds in nats: -0.1 ~ p 0.90, -1 ~ p 0.37, -3 ~ p 0.05.
BUCKETS: list[tuple[str, float | None]] = [
    ("high", -0.1),
    ("mid", -1.0),
    ("low", -3.0),
    ("very_low", None),
]


def bucket(logprob: float) -> str:
    for name, low in BUCKETS:
        if low is None or logprob >= low:
            return name
    return BUCKETS[-1][0]


@dataclass
class TraceOptions:
    service: str | None
    gateway_url: str | None
    admin_api_key: str | None
    session: str | None
    group: str | None
    tokenizer_path: str | None
    as_json: bool
    html: Path | None


@dataclass
class Source:
    """Where the trace is read from: a gateway, its admin key, and maybe the service's state
    (for the models' tokenizer folders)."""

    url: str
    key: str
    service: str | None
    models: dict[str, Any]


def _source(o: TraceOptions, default_service: str) -> Source:
    if o.gateway_url:
        key = o.admin_api_key or ""
        if not key:
            raise CLIError(
                "--gateway-url needs the gateway's admin key: set AREAL_ADMIN_API_KEY or pass "
                "--admin-api-key",
                code=2,
            )
        return Source(o.gateway_url.rstrip("/"), key, None, {})
    from areal_cli.lifecycle import require_state
    from areal_cli.reconcile import gateway_alive

    service = st.check_name("service", default_service if o.service is None else o.service)
    s = require_state(GROUP, service)
    url = (s.get("gateway") or {}).get("url", "")
    if not gateway_alive(s) or not url:
        raise CLIError(
            f"inf service '{service}' is not running (its gateway is dead); "
            f"start it again with `areal inf run --service {service} --force`"
        )
    key = st.load_secrets(GROUP, service).get("admin_api_key", "")
    if not key:
        raise CLIError(
            f"no admin key recorded for inf service '{service}' "
            f"({st.secrets_path(GROUP, service)} is missing)"
        )
    return Source(url.rstrip("/"), key, service, dict(s.get("models") or {}))


def _gateway(src: Source, method: str, path: str, what: str, body: Any = None) -> Any:
    """The answer of one call; a refusal as one line naming `what` was asked for."""
    status, payload = call(method, src.url + path, key=src.key, body=body, timeout=60)
    if status == 200:
        return payload
    where = f"inf service '{src.service}'" if src.service else src.url
    if status == 404:
        # The gateway's words follow: they may name internals (a group's pin reads as a
        # session there), so the line leads with what the user asked for.
        raise CLIError(f"{what} not found on {where} ({error_message(payload)})")
    if status in (401, 403):
        raise CLIError(f"the gateway of {where} refused the admin key: {error_message(payload)}")
    raise CLIError(f"{method} {path} on {where}: HTTP {status}: {error_message(payload)}")


def _tokenizer(
    src: Source, model: str, override: str | None
) -> tuple[Pieces | None, str | None, str]:
    """(Pieces or None, the folder, why there is none)."""
    from areal_cli.inf.trace_pieces import Pieces

    if override:
        return Pieces.from_dir(override), override, ""
    rec = src.models.get(model) or {}
    path = rec.get("tokenizer_path") or rec.get("model_path")
    if not path:
        why = (
            f"model '{model}' has no tokenizer folder recorded on this machine"
            if src.service
            else "no --tokenizer-path given"
        )
        return None, None, why
    if not (Path(path) / "tokenizer.json").is_file():
        return None, str(path), f"no tokenizer.json in {path}"
    return Pieces.from_dir(path), str(path), ""


def fetch(src: Source, session: str | None, group: str | None) -> tuple[list[dict[str, Any]], str]:
    """The rows (style individual, rewards as set) and the model they were made with."""
    body: dict[str, Any] = {"style": "individual", "discount": 0.0}
    model = ""
    if session:
        model = _model_of(src, session)  # first: an unknown session is a plain 404 here
        body["session_ids"] = [session]
        what = f"session '{session}'"
    else:
        body["group_id"] = group
        what = f"group '{group}'"
    doc = _gateway(src, "POST", "/rl/export_trajectories", what, body)
    rows = doc.get("rows", []) if isinstance(doc, dict) else []
    if group and rows:
        model = _model_of(src, str(rows[0].get("session_id", "")))
    return rows, model


def _model_of(src: Source, session: str) -> str:
    info = _gateway(src, "GET", "/rl/sessions/" + quote(session, safe=""), f"session '{session}'")
    return str(info.get("model", "")) if isinstance(info, dict) else ""


def build(
    rows: list[dict[str, Any]],
    *,
    model: str,
    pieces: Pieces | None,
    query: dict[str, str],
    source: dict[str, Any],
    tokenizer: dict[str, Any],
) -> dict[str, Any]:
    """The trace document (`--json`): sessions in export order, each with its interactions."""
    sessions: dict[str, dict[str, Any]] = {}
    for row in rows:
        sid = str(row.get("session_id", ""))
        sess = sessions.setdefault(
            sid,
            {
                "session_id": sid,
                "group_id": row.get("group_id", ""),
                "task_id": row.get("task_id", ""),
                "interactions": [],
                "_responses": [],
                "_last_version": None,
            },
        )
        rid = row.get("response_id") or row.get("interaction_id")
        if rid not in sess["_responses"]:
            sess["_responses"].append(rid)
        sess["interactions"].append(_interaction(row, len(sess["_responses"]), pieces, sess))
    out = []
    for sess in sessions.values():
        sess.pop("_responses")
        sess.pop("_last_version")
        sess["reward_total"] = sum(i["reward"] for i in sess["interactions"])
        out.append(sess)
    return {
        "source": source,
        "model": model,
        "query": query,
        "tokenizer": tokenizer,
        "logprob_buckets": [{"name": n, "min": m} for n, m in BUCKETS],
        "sessions": out,
    }


def _interaction(
    row: dict[str, Any], turn: int, pieces: Pieces | None, sess: dict[str, Any]
) -> dict[str, Any]:
    ids, mask = row.get("input_ids", []), row.get("loss_mask", [])
    lps, vers = row.get("logprobs", []), row.get("versions", [])
    tokens = []
    outs: list[float] = []
    versions: list[int] = []
    for i, tid in enumerate(ids):
        m = int(mask[i]) if i < len(mask) else 0
        tok: dict[str, Any] = {
            "id": tid,
            "piece": pieces.piece(tid) if pieces is not None else None,
            "mask": m,
            "logprob": None,
            "version": None,
            "bucket": None,
            "version_change": False,
        }
        if m:
            lp = float(lps[i]) if i < len(lps) else 0.0
            v = int(vers[i]) if i < len(vers) else -1
            tok.update(logprob=lp, version=v, bucket=bucket(lp))
            last = sess["_last_version"]
            tok["version_change"] = last is not None and v != last
            sess["_last_version"] = v
            outs.append(lp)
            if v not in versions:
                versions.append(v)
        tokens.append(tok)
    return {
        "turn": turn,
        "interaction_id": row.get("interaction_id", ""),
        "response_id": row.get("response_id", ""),
        "choice_index": row.get("choice_index", 0),
        "finish_reason": row.get("finish_reason", ""),
        "reward": float(row.get("reward", 0.0)),
        "replicas": row.get("replicas", []),
        "versions": versions,
        "prompt_tokens": sum(1 for t in tokens if not t["mask"]),
        "output_tokens": len(outs),
        "mean_logprob": sum(outs) / len(outs) if outs else None,
        "tokens": tokens,
    }


def _html_target(path: Path) -> Path:
    if path.is_dir():
        raise CLIError(f"--html {path} is a folder; give a file name", code=2)
    if not path.parent.is_dir():
        raise CLIError(f"--html {path}: folder {path.parent} does not exist", code=2)
    return path


def trace(o: TraceOptions, default_service: str) -> int:
    if bool(o.session) == bool(o.group):
        raise CLIError("give exactly one of --session or --group", code=2)
    if o.service is not None and o.gateway_url:
        raise CLIError("give --service or --gateway-url, not both", code=2)
    html_path = _html_target(o.html) if o.html is not None else None
    src = _source(o, default_service)
    rows, model = fetch(src, o.session, o.group)
    pieces, tok_path, why = _tokenizer(src, model, o.tokenizer_path) if rows else (None, None, "")
    if rows and pieces is None:
        print(f"warning: tokens shown as ids: {why} (pass --tokenizer-path)", file=sys.stderr)
    query = {"session_id": o.session} if o.session else {"group_id": str(o.group)}
    doc = build(
        rows,
        model=model,
        pieces=pieces,
        query=query,
        source={"service": src.service, "gateway_url": src.url},
        tokenizer={"path": tok_path, "decoded": pieces is not None},
    )
    if html_path is not None:
        from areal_cli.inf.trace_html import page

        st.write_private(html_path, page(doc).encode())
        turns = sum(len(s["interactions"]) for s in doc["sessions"])
        print(f"wrote {html_path} ({turns} interactions, mode 0600)", file=sys.stderr)
    if o.as_json:
        print(json.dumps(doc, indent=2))
    elif html_path is None:
        from areal_cli.inf.trace_text import render

        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        sys.stdout.write(render(doc, color=color))
    return 0


# Characters that would act instead of show: C0 / C1 controls (an ESC could drive the
# terminal), DEL, and the bidirectional overrides that reorder what is displayed.
_NAMED = {"\n": "↵\n", "\t": "→", "\r": "␍"}
_BIDI = {0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def shown(tok: dict[str, Any]) -> str:
    """A token's piece as displayed: controls made visible, a newline as `↵` then a line
    break, an undecoded or empty piece as `⟨id⟩`."""
    piece = tok.get("piece")
    if not piece:
        return f"⟨{tok['id']}⟩"
    out = []
    for ch in piece:
        code = ord(ch)
        if ch in _NAMED:
            out.append(_NAMED[ch])
        elif code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif code in _BIDI:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def fmt_reward(r: float) -> str:
    return f"{r:g}"


def fmt_mean(m: float) -> str:
    text = f"{m:.3f}"
    return "0.000" if text == "-0.000" else text  # a mean of -1e-6 is no news
