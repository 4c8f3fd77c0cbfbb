"""What every part of the inference core shares: the proxy's settings for it, a request the
prelude has prepared (its generations started), and a choice's answer once its text is
done."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from areal_proxy.engine.base import GenerationRequest
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.output import openai_response as out
from areal_proxy.recording.recorder import OpenTurn


@dataclass(frozen=True, slots=True)
class InferenceConfig:
    """As the server resolved them: `tool_call_parser` is the parser in use ("" for none),
    never the flag's `none` or its empty default (server.py chooses one from the template)."""

    model: str
    context_length: int = 0
    engine_max_tokens: int = 0
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    # A forced call's fixed text as token ids, not text (forced_tools.py; --forced-call-token-ids).
    forced_call_token_ids: bool = False


@dataclass(slots=True)
class Prepared:
    """A request ready to generate: its generations started (one per choice), the session
    turn it records to (None: nothing recorded), and what they share."""

    rid: str
    ot: OpenTurn | None
    prompts: list[list[int]]
    template: GenerationRequest
    # One per choice, with the index of the prompt it answers (choice k = prompt i * n + j).
    recs: list[tuple[GenerationRecord, int]] = field(default_factory=list)
    # Each prompt's ids as JSON where the prompt builder made it (prompt/incremental.py).
    prompts_json: list[bytes | None] = field(default_factory=list)
    # The request's own JSON schema (response_format), that a finished output must meet.
    schema: dict[str, Any] | None = None
    # What an engine's refusal names (refusal.py): prompt i's field, and the field that holds
    # the output constraint.
    prompt_param: Callable[[int], str] = field(default=lambda _: "messages")
    constraint_param: str = "response_format"

    def turn_of(self, k: int) -> OpenTurn | None:
        """The open turn of choice `k`: with one choice the request's own (its interaction id
        is the response id); with several, one sibling interaction each, `<rid>-<k>`."""
        ot = self.ot
        if ot is None or len(self.recs) == 1:
            return ot
        return replace(ot, interaction_id=f"{self.rid}-{k}", response_id=self.rid, choice_index=k)

    def usage(self) -> dict[str, int]:
        recs = self.recs
        return out.usage(
            sum(len(r.prompt_ids) for r, _ in recs), sum(len(r.token_ids) for r, _ in recs)
        )


@dataclass(slots=True)
class Answer:
    """One choice's finished answer as the text pipeline read it (pipeline.py): what the
    schema check, the commit and the endpoint's response are made from."""

    # The whole visible text (stop strings cut), and the finish reason it ended with before
    # the tool-call rule ("stop" with calls is "tool_calls"): what a JSON schema is checked on.
    text: str
    text_finish: str
    finish: str
    # The text read by the output parsers: `content` is `text` where there are none.
    content: str | None
    reasoning: str | None = None
    # The parser's ToolCall objects (their ids as the client got them when streamed).
    tool_calls: list[Any] = field(default_factory=list)
    # (calls the output made, calls the parser read), as recorded.
    call_counts: tuple[int, int] = (0, 0)
