"""The text pipeline of one choice: output ids -> the text the client sees, piece by piece.

One engine step in, one Piece out: the ids detokenised (without the stop token that ended
them), cut at a stop string, read by the output parsers (reasoning, tool calls), and on the
last step the finish reason after every rule. A streamed answer sends each piece as it is
made; a whole answer is one piece, made of the whole output the engine's non-streamed call
returned, and what the pipeline collected is its Answer. Either way the same rules run once:

- a stop string ends the text and makes the finish "stop" (the engine request is aborted
  when the engine did not stop by itself);
- `parallel_tool_calls: false` keeps the first tool call only;
- "stop" with a tool call read is "tool_calls".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_proxy.common.tokenizer import IncrementalDetokenizer, ModelTokenizer
from areal_proxy.engine.base import GenerationRequest
from areal_proxy.generation.controller import GenerationController, GenerationRecord, Step
from areal_proxy.inference.prepared import Answer
from areal_proxy.output.parsing import collect_events, first_call_only
from areal_proxy.output.stop_strings import StopChecker
from areal_runtime.openai import Sampling


@dataclass(slots=True)
class Piece:
    """What one engine step adds to an answer, as the client may see it."""

    text: str
    # The output parsers' events for `text` (None: no parser, the text is all content).
    events: list[Any] | None
    step: Step
    # Set on the last piece only: the answer's finish reason after every rule.
    finish_reason: str | None


class TextPipeline:
    """One choice's text, fed engine steps in order (`feed`) or its whole output (`whole`)."""

    __slots__ = (
        "_controller",
        "_detok",
        "_events",
        "_finish",
        "_keep",
        "_one_call",
        "_rec",
        "_skip",
        "_stop_ids",
        "_stopper",
        "_streamer",
        "_text_finish",
        "_texts",
        "_tok",
    )

    def __init__(
        self,
        tok: ModelTokenizer,
        controller: GenerationController,
        rec: GenerationRecord,
        template: GenerationRequest,
        sampling: Sampling,
        parser: Any | None,
        *,
        one_call: bool = False,
        keep: bool = True,
    ) -> None:
        """`parser`: the request's OutputParser (output_parsing.py), None for plain text;
        `one_call`: `parallel_tool_calls: false`; `keep`: collect the text and events for
        the Answer (a stream that nobody checks or records needs none)."""
        self._tok = tok
        self._controller = controller
        self._rec = rec
        self._stop_ids = template.stop_token_ids
        self._skip = sampling.skip_special_tokens
        self._detok: IncrementalDetokenizer | None = None
        self._stopper = StopChecker(sampling.stop) if sampling.stop else None
        self._streamer = parser.streamer() if parser is not None else None
        self._one_call = one_call
        self._keep = keep
        self._texts: list[str] = []
        self._events: list[Any] = []
        self._text_finish = ""
        self._finish = ""

    def feed(self, step: Step) -> Piece:
        """The piece of a streamed step; the step that carries the finish reason is the last."""
        detok = self._detok
        if detok is None:
            detok = self._detok = self._tok.detokenizer(skip_special_tokens=self._skip)
        finish = step.finish_reason
        ids = step.token_ids
        if finish is not None:
            ids = self._visible(ids, finish)
        text = detok.feed(ids) if ids else ""
        if finish is not None:
            text += detok.flush()
        text, events, finish = self._rules(text, finish)
        return Piece(text, events, step, finish)

    def whole(self) -> Answer:
        """The answer of a finished generation (the engine's whole output in its record),
        the same rules run over it as one piece."""
        rec = self._rec
        finish = rec.finish_reason or "abort"
        ids = self._visible(rec.token_ids, finish)
        # One decode of the whole output: what a detokenizer fed it all at once returns.
        text = self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""
        self._rules(text, finish)
        return self.answer()

    def answer(self) -> Answer:
        """The answer the pieces so far add up to (the last one fed carried its finish)."""
        text = "".join(self._texts)
        streamer = self._streamer
        if streamer is None:
            return Answer(text, self._text_finish, self._finish, text)
        parsed = collect_events(self._events)
        return Answer(
            text,
            self._text_finish,
            self._finish,
            parsed.content,
            parsed.reasoning_content,
            parsed.tool_calls,
            streamer.call_counts,
        )

    def _visible(self, ids: list[int], finish: str | None) -> list[int]:
        """Output ids whose text the client sees: without the stop token that ended them."""
        if finish == "stop" and ids and ids[-1] in self._stop_ids:
            return ids[:-1]
        return ids

    def _rules(self, text: str, finish: str | None) -> tuple[str, list[Any] | None, str | None]:
        """The text of a piece cut at a stop string, its parser events, and its finish
        reason after the rules (None but on the last piece); what the answer needs kept."""
        stopper = self._stopper
        if stopper is not None:
            text, hit = stopper.feed(text)
            if hit:
                rec = self._rec
                if rec.finish_reason is None:  # the engine is still generating it
                    self._controller.abort_later(rec.engine_rid)
                rec.finish_reason = finish = "stop"
            elif finish is not None:
                text += stopper.flush()
        if self._keep:
            self._texts.append(text)
        events = None
        streamer = self._streamer
        if streamer is not None:
            events = streamer.feed(text) if text else []
            if finish is not None:
                events.extend(streamer.finish())
            if self._one_call:
                events = first_call_only(events)
            if self._keep:
                self._events.extend(events)
        if finish is not None:
            self._text_finish = finish
            if finish == "stop" and streamer is not None and streamer.saw_tool_calls:
                finish = "tool_calls"
            self._finish = finish
        return text, events, finish
