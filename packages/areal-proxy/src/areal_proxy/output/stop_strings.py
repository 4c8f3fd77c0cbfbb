"""OpenAI `stop` strings on the proxy side: the text ends before the stop string.

The engine gets the strings too (it stops generating), but only the proxy sees the text
as the client does (across resubmissions after a pause, for instance), so it checks again
and aborts the engine request when the engine did not stop by itself.
"""

from __future__ import annotations


def truncate_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    cut = -1
    for s in stops:
        i = text.find(s)
        if i >= 0 and (cut < 0 or i < cut):
            cut = i
    return (text[:cut], True) if cut >= 0 else (text, False)


class StopChecker:
    """Streams text through, holding back a tail that may be the start of a stop string."""

    __slots__ = ("_buf", "_hold", "_stops")

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._hold = max(len(s) for s in stops) - 1 if stops else 0
        self._buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        if not text:
            return "", False
        buf = self._buf + text
        out, hit = truncate_at_stop(buf, self._stops)
        if hit:
            self._buf = ""
            return out, True
        keep = 0
        for k in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                keep = k
                break
        self._buf = buf[len(buf) - keep :] if keep else ""
        return (buf[: len(buf) - keep] if keep else buf), False

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out
