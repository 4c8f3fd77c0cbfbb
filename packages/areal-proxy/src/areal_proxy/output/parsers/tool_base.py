"""The streaming tool-call parser machinery every family builds on.

A family names the markers that open a tool-call *region* in the content and
says how to read a region (``parse_region``). The base class does the rest:
it streams content, holds back only what could still become a marker, hands
regions to the family once they are complete, and turns a region that does
not read as valid calls back into plain content, so no text is lost.

``parse`` of the whole output and any split into streamed deltas give the
same result because every decision is made on text that no later text can
change: a region is read only once it is complete (or at the end of output).
Consequently a call is emitted (name first, then its arguments) as soon as
its region is complete; arguments are not streamed token by token, because a
call whose name has gone out can no longer be turned back into content.

Whitespace right before a call (between content and a call, or between two
calls) is dropped, and so is trailing whitespace of the content when the
output made calls; a streamer holds a whitespace run back until the next
non-blank text shows which applies. Text after a call is kept as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._text import WsHolder, find_first, hold_len
from .types import ContentDelta, StreamEvent, ToolCallDelta, new_call_id


@dataclass(slots=True)
class Region:
    """How a region read: ``consumed`` characters after the marker, and the calls.

    ``calls`` None: the region is not a valid tool call; the marker and the
    consumed text become content, unless ``cut``: the output ended inside the call
    (``max_tokens``), and a call cut off is dropped, never shown as content.
    ``calls`` []: markup consumed silently.
    """

    consumed: int
    calls: list[tuple[str, str]] | None
    cut: bool = False


_CONTENT, _REGION, _AFTER_CALL = 0, 1, 2


class ToolParser:
    """Streaming tool-call parser for one response; subclass per family.

    Subclasses set ``markers`` (open a region anywhere in content) and/or
    ``leading_markers`` (open a region only at the very start of the content,
    after whitespace), implement ``parse_region`` and optionally
    ``continuation``.
    """

    markers: tuple[str, ...] = ()
    leading_markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._buf = ""
        self._mode = _CONTENT
        self._marker = ""
        self._at_start = True
        self._ws = WsHolder()
        self._out: list[StreamEvent] = []
        self._n_calls = 0
        # Regions that did not read as calls (left in the content as text, or dropped where
        # the output was cut inside one): calls the model made that the parser could not read.
        self._n_unread = 0
        self._finished = False

    # -- family hooks -------------------------------------------------------

    def start_region(self, marker: str) -> None:
        """Called when a region opens (reset per-region scanning state here)."""

    def parse_region(self, marker: str, body: str, final: bool) -> Region | None:
        """Read the region opened by ``marker``; ``body`` is all text after it.

        Return None while more text is needed (never when ``final``).
        """
        raise NotImplementedError

    def continuation(self, text: str, final: bool) -> tuple[int, str] | None:
        """After a call: does another region follow directly?

        Return None while undecided (never when ``final``), ``(0, "")`` for no,
        or ``(n, marker)`` to consume ``n`` characters and open a region as if
        ``marker`` had been seen.
        """
        return (0, "")

    # -- streaming ----------------------------------------------------------

    @property
    def saw_tool_calls(self) -> bool:
        return self._n_calls > 0

    @property
    def call_counts(self) -> tuple[int, int]:
        """(calls the output made, calls read) so far: a marker that opened no valid call
        counts as a call made and not read."""
        return self._n_calls + self._n_unread, self._n_calls

    def feed(self, delta: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if delta:
            self._buf += delta
            self._run(final=False)
        return self._take()

    def finish(self) -> list[StreamEvent]:
        if not self._finished:
            self._finished = True
            self._run(final=True)
            if self._n_calls:
                self._ws.drop()
            else:
                self._content(self._ws.flush(), raw=True)
        return self._take()

    def _take(self) -> list[StreamEvent]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str, raw: bool = False) -> None:
        if not raw:
            if text.strip():
                self._at_start = False
            text = self._ws.push(text)
        if text:
            if self._out and isinstance(self._out[-1], ContentDelta):
                self._out[-1].text += text
            else:
                self._out.append(ContentDelta(text))

    def _emit_calls(self, calls: list[tuple[str, str]]) -> None:
        self._ws.drop()
        self._at_start = False
        for name, arguments in calls:
            index = self._n_calls
            self._n_calls += 1
            self._out.append(ToolCallDelta(index=index, id=new_call_id(), name=name))
            self._out.append(ToolCallDelta(index=index, arguments=arguments))

    def _open(self, marker: str) -> None:
        self._mode = _REGION
        self._marker = marker
        self.start_region(marker)

    def _run(self, final: bool) -> None:
        while True:
            if self._mode == _CONTENT:
                progressed = self._step_content(final)
            elif self._mode == _REGION:
                progressed = self._step_region(final)
            else:
                progressed = self._step_after_call(final)
            if not progressed:
                return

    def _step_content(self, final: bool) -> bool:
        buf = self._buf
        if final and self.markers:
            # The output ends inside a marker (`max_tokens` cut `<tool_call>` to `<tool_`): a
            # call cut off before it began, dropped like one cut later. A lone first character
            # ("<") is too common in text to be taken for one.
            partial = hold_len(buf, self.markers)
            if partial > 1:
                buf = self._buf = buf[:-partial]
                self._n_unread += 1
        if not buf:
            return False
        found = find_first(buf, self.markers) if self.markers else None
        if self._at_start and self.leading_markers:
            stripped = buf.lstrip()
            lead = len(buf) - len(stripped)
            for marker in self.leading_markers:
                if stripped.startswith(marker):
                    if found is None or lead <= found[0]:
                        found = (lead, marker)
                    break
            else:
                if not final and any(m.startswith(stripped) for m in self.leading_markers):
                    # Only whitespace or a piece of a leading marker so far.
                    return False
        held = 0 if final else hold_len(buf, self.markers)
        # A marker found at i is final unless a longer one could still start at
        # or before i (its beginning is the held suffix).
        if found is not None and (held == 0 or len(buf) - held > found[0]):
            i, marker = found
            self._content(buf[:i])
            self._buf = buf[i + len(marker) :]
            self._open(marker)
            return True
        cut = len(buf) - held
        if cut > 0:
            self._content(buf[:cut])
            self._buf = buf[cut:]
        return False

    def _step_region(self, final: bool) -> bool:
        region = self.parse_region(self._marker, self._buf, final)
        if region is None:
            if final:
                raise AssertionError(f"{type(self).__name__}.parse_region undecided at end")
            return False
        consumed = region.consumed
        if region.calls is None:
            self._n_unread += 1
            if not (final and region.cut):
                self._content(self._marker + self._buf[:consumed])
            self._mode = _CONTENT
        else:
            self._emit_calls(region.calls)
            self._mode = _AFTER_CALL if region.calls else _CONTENT
        self._buf = self._buf[consumed:]
        return True

    def _step_after_call(self, final: bool) -> bool:
        cont = self.continuation(self._buf, final)
        if cont is None:
            if final:
                raise AssertionError(f"{type(self).__name__}.continuation undecided at end")
            return False
        n, marker = cont
        if n == 0:
            self._mode = _CONTENT
        else:
            self._buf = self._buf[n:]
            self._open(marker)
        return True
