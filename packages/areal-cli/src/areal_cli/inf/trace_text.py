"""The terminal view of a trace document (trace.py): per interaction a header line, the
prompt tokens (masked) and the output tokens (trained) with their logprobs.

In colour (a terminal, no NO_COLOR) output tokens are shaded by logprob bucket on a
background, neighbours alternating two shades so token boundaries show; prompt tokens are
grey. In plain text each output token is `[piece logprob]`. Either way a weight version
change is marked `▸v<N>` before the first token of the new version.
"""

from __future__ import annotations

from typing import Any

from areal_cli.inf.trace import fmt_mean, fmt_reward, shown

INDENT = "  "
RESET = "\x1b[0m"
# 256-colour backgrounds per bucket, two shades each (alternating tokens), light text.
_SHADES = {
    "high": (22, 28),
    "mid": (58, 100),
    "low": (130, 166),
    "very_low": (88, 124),
}
_PROMPT_FG = (244, 250)
_MARK = "\x1b[1;38;5;201m"  # bold magenta: a weight version change
_HEAD = "\x1b[1m"
_DIM = "\x1b[2m"

LABELS = {"high": "≥ -0.1", "mid": "≥ -1", "low": "≥ -3", "very_low": "< -3"}


def render(doc: dict[str, Any], *, color: bool) -> str:
    out: list[str] = []
    q = doc["query"]
    what = f"session {q['session_id']}" if "session_id" in q else f"group {q['group_id']}"
    src = doc["source"]
    where = f"inf service '{src['service']}'" if src.get("service") else src["gateway_url"]
    out.append(_style(f"trace of {what} · model {doc['model'] or '?'} · {where}", _HEAD, color))
    out.append(_legend(color))
    if not doc["sessions"]:
        out.append(f"no interactions recorded for {what}")
    for sess in doc["sessions"]:
        out.append("")
        n = len(sess["interactions"])
        out.append(
            _style(
                f"session {sess['session_id']} · group {sess['group_id']} · task "
                f"{sess['task_id']} · {n} interaction{'s' if n != 1 else ''} · reward total "
                f"{fmt_reward(sess['reward_total'])}",
                _HEAD,
                color,
            )
        )
        for it in sess["interactions"]:
            out.extend(_interaction(it, color))
    return "\n".join(out) + "\n"


def _style(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{RESET}" if color else text


def _legend(color: bool) -> str:
    if not color:
        return (
            "legend: prompt tokens are masked (not trained); output tokens read "
            "[piece logprob]; ▸v<N> marks a weight version change"
        )
    cells = [f"\x1b[48;5;{_SHADES[b][0]};38;5;255m {LABELS[b]} {RESET}" for b in _SHADES]
    prompt = f"\x1b[38;5;{_PROMPT_FG[0]}mprompt (masked){RESET}"
    return f"logprob {' '.join(cells)}   {prompt}   {_MARK}▸v<N>{RESET} weight version change"


def _header(it: dict[str, Any]) -> str:
    turn = f"turn {it['turn']}" + (f" choice {it['choice_index']}" if it["choice_index"] else "")
    versions = ",".join(str(v) for v in it["versions"]) or "-"
    mean = it["mean_logprob"]
    replicas = ",".join(sorted({str(r[1]) for r in it["replicas"] if len(r) > 1})) or "-"
    return (
        f"── {turn} · {it['interaction_id']} · finish {it['finish_reason'] or '-'} · reward "
        f"{fmt_reward(it['reward'])} · version {versions} · {it['prompt_tokens']} prompt + "
        f"{it['output_tokens']} output tokens · mean logprob "
        f"{'-' if mean is None else fmt_mean(mean)} · replica {replicas}"
    )


def _interaction(it: dict[str, Any], color: bool) -> list[str]:
    prompt = [t for t in it["tokens"] if not t["mask"]]
    output = [t for t in it["tokens"] if t["mask"]]
    lines = [_style(_header(it), _HEAD, color)]
    lines.append(_style(f"prompt ({len(prompt)} tokens, masked):", _DIM, color))
    lines.append(_indent("".join(_prompt_token(t, i, color) for i, t in enumerate(prompt))))
    how = "" if color else ", each [piece logprob]"
    lines.append(_style(f"output ({len(output)} tokens, trained{how}):", _DIM, color))
    lines.append(_indent("".join(_output_token(t, i, color) for i, t in enumerate(output))))
    return lines


def _indent(text: str) -> str:
    text = text.removesuffix("\n")  # a last newline piece: its `↵` shows it
    return INDENT + text.replace("\n", "\n" + INDENT)


def _prompt_token(tok: dict[str, Any], i: int, color: bool) -> str:
    text = shown(tok)
    if not color:
        return text
    return _paint(text, f"\x1b[38;5;{_PROMPT_FG[i % 2]}m")


def _output_token(tok: dict[str, Any], i: int, color: bool) -> str:
    mark = ""
    if tok["version_change"]:
        mark = _style(f"▸v{tok['version']}", _MARK, color)
    text = shown(tok)
    if not color:
        # A newline piece shows as `↵` in its cell; the line breaks after the cell.
        cell = f"{mark}[{text.replace(chr(10), '')} {tok['logprob']:.2f}]"
        return cell + ("\n" if "\n" in text else "")
    bg = _SHADES[tok["bucket"]][i % 2]
    return mark + _paint(text, f"\x1b[48;5;{bg};38;5;255m")


def _paint(text: str, code: str) -> str:
    """Colour `text`, each line on its own: a colour left open across a line break would
    paint the indent of the next line."""
    return "\n".join(f"{code}{part}{RESET}" if part else "" for part in text.split("\n"))
