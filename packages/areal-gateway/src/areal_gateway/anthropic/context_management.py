"""`context_management`: Anthropic's server-side edits of the conversation, accepted only
where they provably change nothing.

areal edits no context: the prompt is the conversation the client sent, which is also what
an RL session records. An edit that would remove something from the prompt (older thinking,
old tool results) would make the model see another conversation than the one sent, so it
is a 400 naming the edit and why. An edit that removes nothing is accepted:

- `clear_thinking_20251015` with `keep: "all"` (or `{"type": "all"}`): keeps every thinking
  block, by definition (Claude Code sends this one on every request);
- `clear_thinking_20251015` keeping the last N assistant turns' thinking (`keep:
  {"type": "thinking_turns", "value": N}`, N = 1 when absent) when no more than N assistant
  turns hold a thinking block (none at all, in particular): nothing to clear yet.

The answer then says no edit was applied (`context_management.applied_edits: []`, as
Anthropic's answer to a request with `context_management`).
"""

from __future__ import annotations

from typing import Any

from areal_gateway.anthropic.errors import invalid, unsupported

CLEAR_THINKING = "clear_thinking_20251015"

_WHY = (
    "areal edits no context (the prompt is the conversation sent, which an RL session "
    "records); send the conversation you want answered, or an edit that removes nothing"
)


def _thinking_turns(messages: Any) -> int:
    """Assistant turns that hold a thinking block (the body's messages, checked later)."""
    if not isinstance(messages, list):
        return 0
    n = 0
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking")
            for b in content
        ):
            n += 1
    return n


def _kept_turns(keep: Any, path: str) -> int | None:
    """How many recent thinking turns `keep` keeps (None: all)."""
    if keep is None:
        return 1  # Anthropic's default
    if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all"):
        return None
    if isinstance(keep, dict) and keep.get("type") == "thinking_turns":
        value = keep.get("value")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid(f"{path}.value", "must be an integer of at least 1")
        return value
    raise invalid(path, "must be 'all', {'type': 'all'} or {'type': 'thinking_turns', 'value': N}")


def check(raw: Any, messages: Any) -> None:
    """Accept `context_management` whose edits change nothing, else raise a 400."""
    if not isinstance(raw, dict):
        raise invalid("context_management", "must be an object")
    for key, value in raw.items():
        if key != "edits" and value is not None:
            raise unsupported(f"context_management.{key}", f"is not supported ({_WHY})")
    edits = raw.get("edits")
    if edits is None:
        return
    if not isinstance(edits, list):
        raise invalid("context_management.edits", "must be an array of edits")
    for i, edit in enumerate(edits):
        p = f"context_management.edits.{i}"
        if not isinstance(edit, dict) or not isinstance(edit.get("type"), str):
            raise invalid(p, "an edit must be an object with a string 'type'")
        kind = edit["type"]
        if kind != CLEAR_THINKING:
            raise unsupported(
                f"{p}.type",
                f"edit {kind!r} would remove content from the prompt: {_WHY}",
            )
        for key, value in edit.items():
            if key not in ("type", "keep") and value is not None:
                raise unsupported(f"{p}.{key}", "is not supported by areal")
        kept = _kept_turns(edit.get("keep"), f"{p}.keep")
        if kept is None:
            continue
        turns = _thinking_turns(messages)
        if turns > kept:
            raise unsupported(
                f"{p}.keep",
                f"keeping the thinking of the last {kept} assistant turn(s) would clear it "
                f"from {turns - kept} earlier one(s): {_WHY} (keep: 'all' changes nothing)",
            )
