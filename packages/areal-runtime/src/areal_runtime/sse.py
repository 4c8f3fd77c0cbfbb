"""Server-sent events: the one reader and writer of `data:` events every service uses.

The reader is fed bytes as they arrive and returns every event they complete, all at once:
a streaming engine under load has several events waiting in the response buffer, and
handling them as one batch (one wake-up of whoever reads) is what keeps the per-token cost of
a stream small. Events are read as the SSE format defines them (lines up to a blank line;
`data:` lines joined with a newline; other fields ignored), whatever the size of a line.
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"


def encode(data: bytes) -> bytes:
    """One event holding `data`. Compact JSON has no raw line break; should one occur
    (pretty-printed JSON), it is split over several `data:` lines, which a reader joins back
    with a newline (valid JSON whitespace)."""
    if b"\n" in data or b"\r" in data:
        lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
    return b"data: " + data + b"\n\n"


def encode_all(batch: list[bytes]) -> bytes:
    """The events for payloads that go out together, as one write."""
    if len(batch) == 1:
        return encode(batch[0])
    return b"".join(encode(data) for data in batch)


class SSEReader:
    """The `data` payloads of an event stream, fed in pieces of any size.

    A payload is stripped of surrounding whitespace (the JSON a payload holds does not
    care, and `[DONE]` compares equal however it is padded). Each byte is scanned once."""

    __slots__ = ("_buf", "_data", "_scanned")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scanned = 0
        # The `data:` lines of the event being read (it ends at a blank line).
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of every event `chunk` completes, in order (often none or one)."""
        buf = self._buf
        buf += chunk
        out: list[bytes] = []
        start = 0
        while (end := buf.find(b"\n", self._scanned)) != -1:
            line = bytes(buf[start:end])
            start = self._scanned = end + 1
            self._line(line, out)
        if start:
            del buf[:start]
        self._scanned = len(buf)  # what is left holds no newline
        return out

    def close(self) -> list[bytes]:
        """The payload of an event the stream ended without a blank line after."""
        out: list[bytes] = []
        if self._buf:
            self._line(bytes(self._buf), out)
            self._buf.clear()
            self._scanned = 0
        if self._data:
            out.append(b"\n".join(self._data).strip())
            self._data = []
        return out

    def _line(self, line: bytes, out: list[bytes]) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if self._data:
                out.append(b"\n".join(self._data).strip())
                self._data = []
        elif line.startswith(b"data:"):
            # One space after the colon is the format's, not the payload's.
            self._data.append(line[6:] if line[5:6] == b" " else line[5:])
