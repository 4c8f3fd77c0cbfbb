"""Reasoning parsers: split ``<think>...</think>`` off the output.

Reasoning text is stripped of surrounding whitespace and so is the start of
the content that follows ``</think>``. Only the first reasoning block counts;
tags later in the content are left as they are.

- ``qwen3``: the output may start with ``<think>`` (reasoning until
  ``</think>``, or to the end when it never closes). Without an opening tag
  (the chat template already put it in the prompt) the text before a lone
  ``</think>`` is reasoning, and output with no tags at all is content. The
  latter two cannot be told apart before ``</think>`` or the end arrives, so
  a streamer holds such output back until then.
- ``deepseek-r1`` (alias ``qwen3-thinking``): the output starts inside the
  reasoning, with or without ``<think>``; everything up to ``</think>`` is
  reasoning, and all of it when ``</think>`` never comes. Streams at once.
"""

from __future__ import annotations

from ._text import WsHolder, hold_len
from .registry import register_reasoning_parser
from .types import ContentDelta, ReasoningDelta

THINK_START = "<think>"
THINK_END = "</think>"

_START, _UNSURE, _REASONING, _CONTENT_START, _CONTENT = range(5)

ReasoningEvent = ContentDelta | ReasoningDelta


class ReasoningParser:
    """Streaming reasoning splitter for one response; subclass per family."""

    start_tag = THINK_START
    end_tag = THINK_END
    # True: output without an opening tag begins inside the reasoning.
    starts_in_reasoning = False

    def __init__(self) -> None:
        self._buf = ""
        self._state = _START
        self._ws = WsHolder(strip_leading=True)
        self._out: list[ReasoningEvent] = []
        self._finished = False
        self._search_from = 0

    def feed(self, delta: str) -> list[ReasoningEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if delta:
            self._buf += delta
            self._run(final=False)
        return self._take()

    def finish(self) -> list[ReasoningEvent]:
        if not self._finished:
            self._finished = True
            self._run(final=True)
            self._ws.drop()
        return self._take()

    def _take(self) -> list[ReasoningEvent]:
        out, self._out = self._out, []
        return out

    def _emit(self, event: ReasoningEvent) -> None:
        if not event.text:
            return
        last = self._out[-1] if self._out else None
        if last is not None and type(last) is type(event):
            last.text += event.text
        else:
            self._out.append(event)

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _end_reasoning(self, text: str) -> None:
        self._emit(ReasoningDelta(self._ws.push(text)))
        self._ws.drop()
        self._state = _CONTENT_START

    def _step(self, final: bool) -> bool:
        buf = self._buf
        state = self._state
        if state == _START:
            stripped = buf.lstrip()
            if stripped.startswith(self.start_tag):
                self._buf = stripped[len(self.start_tag) :]
                self._state = _REASONING
                return True
            if not final and self.start_tag.startswith(stripped):
                return False
            self._state = _REASONING if self.starts_in_reasoning else _UNSURE
            return True
        if state == _UNSURE:
            i = buf.find(self.end_tag, self._search_from)
            if i >= 0:
                self._buf = buf[i + len(self.end_tag) :]
                self._end_reasoning(buf[:i])
                return True
            if final:
                self._emit(ContentDelta(buf))
                self._buf = ""
                self._state = _CONTENT
            else:
                self._search_from = max(0, len(buf) - len(self.end_tag) + 1)
            return False
        if state == _REASONING:
            i = buf.find(self.end_tag)
            if i >= 0:
                self._buf = buf[i + len(self.end_tag) :]
                self._end_reasoning(buf[:i])
                return True
            cut = len(buf) if final else len(buf) - hold_len(buf, (self.end_tag,))
            if cut > 0:
                self._emit(ReasoningDelta(self._ws.push(buf[:cut])))
                self._buf = buf[cut:]
            return False
        if state == _CONTENT_START:
            stripped = buf.lstrip()
            if not stripped:
                self._buf = ""
                return False
            self._buf = stripped
            self._state = _CONTENT
            return True
        if buf:
            self._emit(ContentDelta(buf))
            self._buf = ""
        return False


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


@register_reasoning_parser("qwen3-thinking")
@register_reasoning_parser("deepseek-r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
