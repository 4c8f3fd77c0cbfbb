"""areal_runtime.bodycost: the estimate follows structure, not only bytes, and orders bodies
the way their real parse does."""

from __future__ import annotations

import time

import orjson

from areal_runtime import bodycost
from areal_runtime.errors import PayloadTooLarge, ServiceError


def _parse_s(body: bytes) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        orjson.loads(body)
        best = min(best, time.perf_counter() - t)
    return best


def test_same_size_different_shape() -> None:
    prose = orjson.dumps({"content": "lorem ipsum dolor sit amet " * 40_000})
    empties = orjson.dumps({"pad": [{}] * (len(prose) // 3)})
    lists = orjson.dumps({"pad": [[]] * (len(prose) // 3)})
    assert bodycost.parses_inline(prose) is (len(prose) <= bodycost.INLINE_NS)
    for heavy in (empties, lists):
        assert bodycost.cost_ns(heavy) > 20 * bodycost.cost_ns(prose)
        # The real parse agrees on the order (by far: not a timing-sensitive margin).
        assert _parse_s(heavy) > 3 * _parse_s(prose)
        assert not bodycost.parses_inline(heavy)


def test_refusal_is_a_413_naming_the_counts_and_what_to_do() -> None:
    body = orjson.dumps({"pad": [{}] * 200_000})
    err = bodycost.too_complex(body)
    assert isinstance(err, PayloadTooLarge)
    assert (err.http_status, err.code) == (413, "body_too_complex")
    assert "200,002 JSON objects and arrays" in err.message and "Send fewer" in err.message
    # It survives the wire as the same class.
    again = ServiceError.from_detail(err.detail())
    assert isinstance(again, PayloadTooLarge) and again.code == "body_too_complex"
    assert bodycost.too_complex(orjson.dumps({"ids": list(range(100_000))})) is None
    assert bodycost.too_complex(b"[]" * 10) is None  # small bodies are never counted


def test_small_bodies_are_not_counted() -> None:
    assert bodycost.parses_inline(b"[" * bodycost.COUNT_FROM)
    assert not bodycost.parses_inline(b"[" * (bodycost.COUNT_FROM + 1))
