"""Where, in a chat template's rendering, the previous turn's answer ends: the `concat`
prompt is the previous turn's exact prompt + answer ids, then the tokens of what the
template writes from that point on (the newline after ChatML's `<|im_end|>`, nothing after
Llama-3's `<|eot_id|>`, the new messages, the generation prompt).

The answer's own rendering is never compared with what the model sampled: the lineage
already matched the echoed answer to the recorded one by meaning (role, text, tool calls'
names and parsed arguments), and the sampled ids stand for it, however the template would
write it again (tool calls with other JSON spacing, reasoning left out, SmolLM2's template
that writes no tool calls at all). What must be found is only the end of the answer's turn,
by the template's structure, which is made of special tokens:

- `TurnEnd`: the special token a template writes right after an assistant's text (probed
  once with a sentinel answer). With a cached state (the previous prompt's rendering, which
  the new one starts with), the answer's turn ends at the first special token after it.
- Otherwise (the previous prompt is not cached, or the template now writes the earlier
  conversation differently, as Qwen3's drops the reasoning of answers before the last user
  query), the conversation up to and including the answer is rendered alone: its special
  tokens, in order, are the first ones of the whole rendering, and the last of them ends the
  answer's turn (`end_in_rendering`).

The end-of-turn token itself is the answer's last sampled id when the model stopped on it,
and the template's when the answer was cut (max_tokens, a stop string): `Boundary.after`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The probe's answer: text no template rewrites.
_SENTINEL = "areal-probe-answer-7f3c"
_PROBE = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": _SENTINEL},
    {"role": "user", "content": "again"},
]


class Specials:
    """The tokenizer's special added tokens, and where they occur in a rendered text (as
    the tokenizer splits them out: leftmost, longest first)."""

    __slots__ = ("_pattern", "ids")

    def __init__(self, added_tokens: list[dict[str, Any]]) -> None:
        self.ids: dict[str, int] = {
            str(t["content"]): int(t["id"])
            for t in added_tokens
            if t.get("special") and isinstance(t.get("content"), str) and t["content"]
        }
        alternatives = sorted(self.ids, key=len, reverse=True)
        self._pattern = (
            re.compile("|".join(re.escape(c) for c in alternatives)) if alternatives else None
        )

    def __bool__(self) -> bool:
        return self._pattern is not None

    def first(self, text: str, start: int) -> re.Match[str] | None:
        return self._pattern.search(text, start) if self._pattern is not None else None

    def all(self, text: str) -> list[re.Match[str]]:
        return list(self._pattern.finditer(text)) if self._pattern is not None else []


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """The special token a template writes right after an assistant's answer."""

    token: str
    token_id: int

    @classmethod
    def probe(
        cls, render: Callable[[list[dict[str, Any]]], str], specials: Specials
    ) -> TurnEnd | None:
        """From a rendering of user, assistant, user (no generation prompt): the special
        token right after the answer's text, or None (the template failed on the probe, or
        writes something else there: such a template's turns are found by
        `end_in_rendering` alone)."""
        try:
            text = render(_PROBE)
        except Exception:
            return None
        at = text.find(_SENTINEL)
        if at < 0:
            return None
        at += len(_SENTINEL)
        m = specials.first(text, at)
        if m is None or m.start() != at:
            return None
        return cls(m.group(), specials.ids[m.group()])


@dataclass(frozen=True, slots=True)
class Boundary:
    """An answer's end-of-turn token found in a rendering: `start` and `end` are its
    characters there, `token_id` its id."""

    start: int
    end: int
    token_id: int

    def after(self, ended: bool) -> int:
        """Where the text to tokenize after the answer's sampled ids starts: past the
        end-of-turn token when the answer ended with one (the model stopped on it), at it
        when the answer was cut (the template's token then follows the sampled ids)."""
        return self.end if ended else self.start


def end_after_prompt(
    rendered: str, prompt_text: str, turn_end: TurnEnd | None, specials: Specials
) -> Boundary | None:
    """The answer's end in `rendered`, which starts with `prompt_text` (the rendering of the
    prompt the answer was sampled under, generation prompt included): the first special
    token after it, which must be the template's end-of-turn token."""
    if turn_end is None or not rendered.startswith(prompt_text):
        return None
    m = specials.first(rendered, len(prompt_text))
    if m is None or m.group() != turn_end.token:
        return None  # the answer's rendering holds special tokens of its own, or none ends it
    return Boundary(m.start(), m.end(), turn_end.token_id)


def end_in_rendering(head: str, rendered: str, specials: Specials) -> Boundary | None:
    """The answer's end in `rendered`, the whole conversation, given `head`: the rendering
    of the conversation up to and including the answer (no generation prompt). `head`'s
    special tokens must be the first ones of `rendered`, in order, its last one must end it
    (nothing but whitespace after), and `rendered` must go on as `head` ends."""
    marks = specials.all(head)
    if not marks:
        return None
    last = marks[-1]
    tail = head[last.end() :]
    if tail.strip():
        return None  # the template writes no special token after an answer
    ids = specials.ids
    it = specials.all(rendered)
    if len(it) < len(marks):
        return None
    for a, b in zip(marks, it, strict=False):
        if ids[a.group()] != ids[b.group()]:
            return None
    m = it[len(marks) - 1]
    if not rendered.startswith(tail, m.end()):
        return None
    return Boundary(m.start(), m.end(), ids[m.group()])
