"""A chat turn's prompt ids, continued from the previous turn of its session where that is
exact, so that a turn costs what is new rather than the whole conversation.

`hf`: the conversation is rendered whole (microseconds per message: string joins), then
checked to extend the previous prompt's rendering up to its last cut (prompt/cuts.py); only
the text from that cut on is tokenized, and the ids before it are the previous prompt's.
The ids equal a full tokenization of the rendering, bit for bit (cuts.py says why).

`concat`: the previous turn's exact prompt + answer ids continue, followed by the tokens of
what the rendering adds after their text, as `recording/concat.py` does, but with the text
of those ids kept from the previous turn instead of decoding the whole history again.

Anything else takes the full path and names why (`FALLBACK_REASONS`), for the metric and the
session's status:
- `history_edited`: the messages extend no recorded turn of the session (an earlier message
  edited or dropped, a new system prompt);
- `not_cached`: they extend a recorded turn whose prompt is no longer in memory (the session
  was evicted from the cache, or the proxy restarted since);
- `render_changed`: they extend a cached turn, but the template renders that turn's part
  differently now (a template whose output for old messages depends on later ones, other
  tools or template arguments, an answer echoed back differently);
- `tokenizer_unsupported`: the tokenizer has no added token a prompt can be cut at.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson

from areal_proxy.chat_template import PromptBuilder, PromptTooLong
from areal_proxy.prompt.cuts import Cuts
from areal_proxy.prompt.state import PromptState
from areal_proxy.recording.model import Interaction
from areal_proxy.tokenizer import ModelTokenizer

FALLBACK_REASONS = ("history_edited", "not_cached", "render_changed", "tokenizer_unsupported")
# Tokens decoded before new ones to find their text (a leading space, a character split
# across tokens): the same window as a streaming detokenizer's.
_DECODE_WINDOW = 6


@dataclass(slots=True)
class Previous:
    """What a session knows, before building a turn's prompt, of the turns before it."""

    # The recorded turn this one continues (the lineage's parent) and how many of the
    # request's messages its conversation covers.
    parent: Interaction | None = None
    covered: int = 0
    # The parent's prompt state when it is cached, and the session's latest cached one.
    parent_state: PromptState | None = None
    latest_state: PromptState | None = None
    # Why there is no parent state to continue ("" for a session's first turn).
    reason: str = ""


@dataclass(slots=True)
class Built:
    ids: list[int]
    # What the next turn may continue from (None: nothing to keep).
    state: PromptState | None
    incremental: bool = False
    reason: str = ""
    # Leading ids that are the parent's prompt + answer ids (known without comparing).
    reused: int = 0
    # Ids tokenized for this prompt (the rest were taken over).
    tokenized: int = 0
    # `ids` as a JSON array, made from the previous turn's encoding (None: not made).
    ids_json: bytes | None = None

    @property
    def path(self) -> str:
        if self.incremental:
            return "incremental"
        return f"full:{self.reason}" if self.reason else "full"


class SessionPrompts:
    """Builds a session turn's prompt from its `Previous`; stateless between calls (the
    states live in the session book's TurnCache), so any thread may call it."""

    def __init__(self, builder: PromptBuilder, tok: ModelTokenizer) -> None:
        self.builder = builder
        self.tok = tok
        self.template_type = builder.template_type
        self.cuts = Cuts.of(tok.added_tokens, tok.unk_token)
        # One int object per token id, shared by every cached prompt: a list of ids then
        # costs its 8-byte pointers, not 36 bytes a token.
        self._ints = list(range(tok.vocab_size))

    def interned(self, ids: list[int]) -> list[int]:
        table = self._ints
        n = len(table)
        return [table[i] if 0 <= i < n else i for i in ids]

    def build(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        extra: dict[str, Any] | None,
        prev: Previous,
        *,
        limit: int = 0,
        rendered: str | None = None,
    ) -> Built:
        if rendered is None:
            rendered = self.builder.render_checked(messages, tools, extra, limit)
        if self.template_type == "concat":
            return self._concat(messages, tools, extra, prev, limit, rendered)
        return self._hf(rendered, prev, limit)

    def after_answer(self, state: PromptState | None, output_ids: list[int]) -> PromptState | None:
        """The state a turn leaves once answered: `concat` continues its answer's ids too."""
        if state is None or self.template_type != "concat":
            return state
        text = self._decoded_after(state.ids, output_ids)
        if text is None:
            return None
        return replace(state, text=state.text + text, answer=self.interned(output_ids))

    # ---- hf --------------------------------------------------------------------------

    def _hf(self, rendered: str, prev: Previous, limit: int) -> Built:
        state = prev.parent_state or prev.latest_state
        reason = prev.reason
        if state is not None:
            if self.cuts is None:
                reason = "tokenizer_unsupported"
            else:
                built = self._continue_hf(state, rendered, limit)
                if built is not None:
                    if state is prev.parent_state:
                        built.reused = state.cut_tokens[-1]
                    return self._encoded(built, state)
                if state is prev.parent_state:
                    reason = "render_changed"
                else:
                    reason = reason or "history_edited"
        ids = self.interned(self.tok.encode(rendered, limit=limit))
        return Built(ids, self._hf_state(rendered, ids), reason=reason, tokenized=len(ids))

    @staticmethod
    def _encoded(built: Built, prev: PromptState) -> Built:
        """`built` (which continues `prev`'s kept ids) with its ids' JSON, and its state's."""
        if not prev.json:
            return built  # nothing kept to start from: the engine client encodes the ids
        new = built.ids[prev.kept :]
        head = prev.kept_json()
        built.ids_json = encoded = _array(head, new)
        state = built.state
        if state is not None:
            extra = state.kept - prev.kept  # ids of `new` the next prompt takes over too
            if extra == len(new):
                end = len(encoded) - 1
            else:
                part = orjson.dumps(new[:extra])[1:-1] if extra else b""
                end = 1 + len(head) + (1 if len(head) and part else 0) + len(part)
            built.state = replace(state, json=encoded, json_end=end)
        return built

    def _continue_hf(self, prev: PromptState, rendered: str, limit: int) -> Built | None:
        assert self.cuts is not None
        if not prev.cut_chars or not rendered.startswith(prev.text):
            return None
        start = prev.cut_chars[-1]
        found = self.cuts.matches(rendered, start)
        if not found or found[0][0] != start:
            return None  # the new rendering has no added token where the old one was cut
        ends = [p for p, _ in found[1:]] + [len(rendered)]
        pieces = [rendered[p:e] for (p, _), e in zip(found, ends, strict=True)]
        cut_chars = list(prev.cut_chars[:-1])
        cut_tokens = list(prev.cut_tokens[:-1])
        ids = prev.ids[: prev.cut_tokens[-1]]
        tokenized = 0
        for (pos, token_id), piece_ids in zip(found, self.tok.encode_pieces(pieces), strict=True):
            if not piece_ids or piece_ids[0] != token_id:
                return None  # the tokenizer did not split where cuts.py says it must
            cut_chars.append(pos)
            cut_tokens.append(len(ids))
            ids.extend(self.interned(piece_ids))
            tokenized += len(piece_ids)
        if limit and len(ids) >= limit:
            raise PromptTooLong(len(ids))
        state = PromptState(rendered[: cut_chars[-1]], ids, tuple(cut_chars), tuple(cut_tokens))
        return Built(ids, state, incremental=True, tokenized=tokenized)

    def _hf_state(self, rendered: str, ids: list[int]) -> PromptState:
        """The state of a prompt tokenized whole: its cuts, each an added token's occurrence
        in the text matched to that token's id in order (one id each: cuts.py)."""
        if self.cuts is None:
            return PromptState("", ids)
        found = self.cuts.matches(rendered, 0)
        cut_ids = frozenset(self.cuts.ids.values())
        at = [i for i, t in enumerate(ids) if t in cut_ids]
        if not found or len(at) != len(found):
            return PromptState("", ids)
        if any(ids[i] != t for i, (_, t) in zip(at, found, strict=True)):
            return PromptState("", ids)
        chars = tuple(p for p, _ in found)
        encoded = orjson.dumps(ids)
        end = len(orjson.dumps(ids[: at[-1]])) - 1
        return PromptState(rendered[: chars[-1]], ids, chars, tuple(at), encoded, end)

    # ---- concat ----------------------------------------------------------------------

    def _concat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        extra: dict[str, Any] | None,
        prev: Previous,
        limit: int,
        rendered: str,
    ) -> Built:
        parent, state = prev.parent, prev.parent_state
        if parent is None or prev.covered <= 0:
            ids = self.interned(self.tok.encode(rendered, limit=limit))
            return Built(ids, self._concat_state(ids), reason=prev.reason, tokenized=len(ids))
        if state is not None and rendered.startswith(state.text):
            new = self.tok.encode(rendered[len(state.text) :])
            ids = state.ids + state.answer
            reused = len(ids)
            ids.extend(self.interned(new))
            if limit and len(ids) >= limit:
                raise PromptTooLong(len(ids))
            text = self._decoded_after(state.ids[-_DECODE_WINDOW:] + state.answer, new)
            keep = PromptState(state.text + text, ids) if text is not None else None
            built = Built(ids, keep, incremental=True, reused=reused, tokenized=len(new))
            return self._encoded(built, state)
        reason = "render_changed" if state is not None else (prev.reason or "not_cached")
        previous = [*parent.prompt_ids, *parent.output_ids]
        ids = self.interned(
            self.builder.prompt_ids(
                messages,
                tools,
                extra,
                previous_ids=previous,
                previous_messages=prev.covered,
                limit=limit,
                rendered=rendered,
            )
        )
        reused = len(previous) if ids[: len(previous)] == previous else 0
        return Built(
            ids, self._concat_state(ids), reason=reason, reused=reused, tokenized=len(ids) - reused
        )

    def _concat_state(self, ids: list[int]) -> PromptState:
        text = self.tok.decode(ids, skip_special_tokens=False)
        encoded = orjson.dumps(ids)
        return PromptState(text, ids, json=encoded, json_end=len(encoded) - 1)

    def _decoded_after(self, before: list[int], new: list[int]) -> str | None:
        """The text `new` adds after `before` in decode(before + new), from a window of
        `before` only; None when the window cannot tell (it ends inside a character)."""
        if not new:
            return ""
        window = before[-_DECODE_WINDOW:]
        head = self.tok.decode(window, skip_special_tokens=False)
        whole = self.tok.decode(window + new, skip_special_tokens=False)
        if head.endswith("\ufffd") or not whole.startswith(head):
            return None
        return whole[len(head) :]


def _array(head: memoryview, ids: list[int]) -> bytes:
    """A JSON array of the ids `head` encodes (the inside of an array), then `ids`: one copy
    of `head`, however long."""
    if not ids:
        return b"".join((b"[", head, b"]"))
    tail = orjson.dumps(ids)
    if not len(head):
        return tail
    return b"".join((b"[", head, b",", memoryview(tail)[1:]))
