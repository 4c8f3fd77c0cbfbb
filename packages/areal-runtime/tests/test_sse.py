"""The shared SSE reader and writer (areal_runtime.sse)."""

from __future__ import annotations

from areal_runtime.sse import DONE, SSEReader, encode, encode_all


def test_reader_returns_every_event_a_piece_completes() -> None:
    r = SSEReader()
    assert r.feed(b'data: {"a":1}\n\ndata: {"a":2}\n\ndata: {"a"') == [b'{"a":1}', b'{"a":2}']
    assert r.feed(b":3}\n") == []
    assert r.feed(b"\n" + DONE) == [b'{"a":3}', b"[DONE]"]


def test_reader_joins_data_lines_ignores_other_fields_and_takes_crlf() -> None:
    r = SSEReader()
    out = r.feed(b'event: x\r\nid: 3\r\ndata: {\r\ndata: "k": 1}\r\n\r\n: comment\n\n')
    assert out == [b'{\n"k": 1}']


def test_reader_keeps_an_unterminated_last_event_for_close() -> None:
    r = SSEReader()
    assert r.feed(b"data: [DONE]") == []
    assert r.close() == [b"[DONE]"]
    assert r.close() == []


def test_reader_takes_a_line_of_any_length_split_anywhere() -> None:
    big = b"x" * 3_000_000
    stream = b"data: " + big + b"\n\n"
    r = SSEReader()
    out: list[bytes] = []
    for i in range(0, len(stream), 65536):
        out += r.feed(stream[i : i + 65536])
    assert out == [big]


def test_encode_round_trips_through_the_reader() -> None:
    payloads = [b'{"a":1}', b'{\n"b": 2\r\n}', b"[DONE]"]
    wire = encode_all(payloads)
    assert encode(payloads[0]) == b'data: {"a":1}\n\n'
    out = SSEReader().feed(wire)
    assert out == [b'{"a":1}', b'{\n"b": 2\n}', b"[DONE]"]
