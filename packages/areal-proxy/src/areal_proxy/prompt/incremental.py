"""A chat turn's prompt ids, continued from the previous turn of its session where that is
exact, so that a turn costs what is new rather than the whole conversation.

`concat` (the default): a turn that extends a recorded one (its parent, found by the
lineage) continues the parent's exact prompt + answer ids, the ids the model saw and
sampled, followed by the tokens of what the template writes after the answer's turn ends
(prompt/boundary.py says how that end is found). With the parent's prompt cached and the
conversation before the answer rendered as it was, that is found in the new text alone
(`incremental`); otherwise the conversation up to the answer is rendered too, and the ids
are still the parent's (`full:not_cached`, `full:render_changed`). Only the new text is
tokenized either way.

`hf` (opt-in): the conversation is rendered whole (microseconds per message: string joins),
then checked to extend the previous prompt's rendering up to its last cut (prompt/cuts.py);
only the text from that cut on is tokenized, and the ids before it are the previous
prompt's. The ids equal a full tokenization of the rendering, bit for bit (cuts.py says
why), so text the model sampled is tokenized again.

Every other turn renders the conversation whole and names why (`FALLBACK_REASONS`), for the
metric, the session's status and the recorded `prompt_path` ("full:<reason>"; "full" alone
is a session's first turn):
- `new_conversation`: a session's turn that extends no recorded turn and carries no earlier
  answer: the first turn of a conversation of its own (a sub-agent, a side call such as a
  title, a new task, a history compacted into a summary). A new chain.
- `history_edited`: a turn that carries earlier answers, yet extends no recorded turn (an
  earlier message edited or dropped, an answer replaced or never sampled here, a new system
  prompt). A new chain.
- `not_cached`: it extends a recorded turn whose prompt is no longer in memory (the session
  was evicted from the cache, or the proxy restarted since). `concat` still continues the
  parent's ids.
- `render_changed`: it extends a cached turn, but the template renders the conversation
  before its answer differently now (a template whose output for old messages depends on
  later ones, other tools or template arguments). `concat` still continues the parent's ids.
- `boundary_unknown` (`concat`): it extends a recorded turn, but the end of that turn's
  answer cannot be found in the template's rendering (a template that writes no special
  token after an answer, and an answer not echoed as the model wrote it): tokenized whole,
  a new chain.
- `tokenizer_unsupported` (`hf`): the tokenizer has no added token a prompt can be cut at.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import orjson

from areal_proxy.common.records import Interaction
from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.prompt.boundary import Specials, TurnEnd, end_after_prompt, end_in_rendering
from areal_proxy.prompt.chat_template import (
    PromptBuilder,
    PromptTooLong,
    TemplateError,
    ToolsNotRendered,
)
from areal_proxy.prompt.concat import continue_tokens
from areal_proxy.prompt.cuts import Cuts
from areal_proxy.prompt.state import PromptState

log = logging.getLogger(__name__)

FALLBACK_REASONS = (
    "new_conversation",
    "history_edited",
    "not_cached",
    "render_changed",
    "boundary_unknown",
    "tokenizer_unsupported",
)


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
        # concat: where an answer's turn ends in the template's rendering (boundary.py).
        self.specials = Specials(tok.added_tokens)
        self.turn_end = TurnEnd.probe(
            lambda m: builder.template.render(m, add_generation_prompt=False), self.specials
        )
        self._end_ids = frozenset(tok.eos_token_ids)
        if self.template_type == "concat" and self.turn_end is None:
            log.warning(
                "concat: the chat template writes no special token right after an answer; "
                "each session turn renders its conversation again to find where the previous "
                "answer ends (prompt_path full:render_changed)"
            )

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
        return replace(state, answer=self.interned(output_ids))

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
            return self._whole(rendered, limit, prev.reason)
        if state is not None:
            found = end_after_prompt(rendered, state.text, self.turn_end, self.specials)
            if found is not None:
                ended = self._ended(parent.output_ids, found.token_id)
                added = self._encode_after(rendered[found.after(ended) :])
                ids = state.ids + state.answer
                reused = len(ids)
                ids.extend(added)
                if limit and len(ids) >= limit:
                    raise PromptTooLong(len(ids))
                keep = PromptState(rendered, ids)
                built = Built(ids, keep, incremental=True, reused=reused, tokenized=len(added))
                return self._encoded(built, state)
        reason = "render_changed" if state is not None else (prev.reason or "not_cached")
        previous = [*parent.prompt_ids, *parent.output_ids]
        new = self._after_answer(
            messages[: prev.covered], tools, extra, rendered, parent.output_ids
        )
        if new is None:
            # Text alone: the rendering goes on exactly from the ids' decoding (a template
            # that writes no special token after an answer, whose answer was echoed as the
            # model wrote it).
            whole = continue_tokens(
                previous,
                rendered,
                lambda t: self.tok.decode(t, skip_special_tokens=False),
                self.tok.encode,
            )
            if whole is None:
                return self._whole(rendered, limit, "boundary_unknown")
            new = whole[len(previous) :]
        reused = len(previous)
        ids = self.interned([*previous, *new])
        if limit and len(ids) >= limit:
            raise PromptTooLong(len(ids))
        return Built(
            ids, self._concat_state(rendered, ids), reason=reason, reused=reused, tokenized=len(new)
        )

    def _whole(self, rendered: str, limit: int, reason: str) -> Built:
        """A prompt tokenized whole: a session's first turn, or a new chain (`reason`)."""
        ids = self.interned(self.tok.encode(rendered, limit=limit))
        return Built(ids, self._concat_state(rendered, ids), reason=reason, tokenized=len(ids))

    def _after_answer(
        self,
        head_messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        extra: dict[str, Any] | None,
        rendered: str,
        output_ids: list[int],
    ) -> list[int] | None:
        """The ids of what `rendered` writes after the answer that ends `head_messages`,
        found by rendering those alone (boundary.end_in_rendering); None where that does
        not line up."""
        try:
            head = self.builder.template.render(
                head_messages, tools=tools, add_generation_prompt=False, extra=extra
            )
        except (TemplateError, ToolsNotRendered):
            return None
        found = end_in_rendering(head, rendered, self.specials)
        if found is None:
            return None
        ended = self._ended(output_ids, found.token_id)
        return self._encode_after(rendered[found.after(ended) :])

    def _ended(self, output_ids: list[int], turn_end_id: int) -> bool:
        """Whether the answer ends with an end-of-turn token the model sampled: the
        template's, or another of the model's (Llama-3's <|eom_id|>, say), which then stands
        for the template's; else it was cut by max_tokens or a stop string, and the
        template's token follows it."""
        return bool(output_ids) and (
            output_ids[-1] == turn_end_id or output_ids[-1] in self._end_ids
        )

    def _encode_after(self, text: str) -> list[int]:
        """The ids of `text` as they follow a special token in a whole tokenization: encoded
        behind the end-of-turn token, which is then dropped (a Metaspace tokenizer prefixes
        the first piece of a text with a space, but not one after a special token)."""
        end = self.turn_end
        if end is not None:
            ids = self.tok.encode(end.token + text)
            if ids and ids[0] == end.token_id:
                return self.interned(ids[1:])
        return self.interned(self.tok.encode(text))

    def _concat_state(self, rendered: str, ids: list[int]) -> PromptState:
        encoded = orjson.dumps(ids)
        return PromptState(rendered, ids, json=encoded, json_end=len(encoded) - 1)


def _array(head: memoryview, ids: list[int]) -> bytes:
    """A JSON array of the ids `head` encodes (the inside of an array), then `ids`: one copy
    of `head`, however long."""
    if not ids:
        return b"".join((b"[", head, b"]"))
    tail = orjson.dumps(ids)
    if not len(head):
        return tail
    return b"".join((b"[", head, b",", memoryview(tail)[1:]))
