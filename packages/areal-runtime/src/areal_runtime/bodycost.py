"""What parsing a JSON body will cost, estimated from its bytes without parsing it.

A body's parse holds the GIL for as long as it takes, and what it takes grows with its
structure more than with its size: 7 MB of prose parses in ~7 ms, 7 MB of empty objects
(`[{},{},...]`, 2.3 M of them) in ~180 ms, and with the collector walking the new containers
nested ones take longer still. A rule on bytes alone lets a small or slowly grown body of that
shape stall a service's event loop, so the services (the gateway's body screen, the proxy's
prompt screen) decide with `cost_ns`:

- `cost_ns(body)` <= `INLINE_NS`: cheap enough to parse on the event loop;
- over it: parsed in the service's screen (a child process, `areal_runtime.offload`), however
  the body was reached (a session's small growth since its last turn included);
- `structure_ns(body)` over `MAX_STRUCTURE_NS`: refused (413 `body_too_complex`) wherever it
  is found, since every hop that must hold the request (the proxy records its messages) would
  pay it again, and no real request needs that many JSON values.

The estimate counts the bytes that open a container (`{`, `[`) and separate values (`,`).
Inside strings they are counted too, which only errs towards the screen (prose has a comma per
~60 characters; 410 kB of an agent's conversation estimates at ~0.5 ms). Counting is one C
pass over the bytes (~0.35 ns a byte: 0.15 ms for that 410 kB body, about what its parse
takes), so it is done only where a body may stay on the loop: one already too big to is
screened without it.
"""

from __future__ import annotations

from areal_runtime.errors import PayloadTooLarge

# Measured with orjson on a 2-core machine (benchmarks/README.md, "Body cost"): ~1 ns a byte
# of string, 80-220 ns an empty container (more once the collector runs), 15-50 ns a scalar.
# Weights err high, so a body near a limit goes the safe way.
NS_PER_BYTE = 1
NS_PER_CONTAINER = 250
NS_PER_VALUE = 25

# At most this long on an event loop per body: a long agent session's turn (hundreds of kB of
# conversation) stays well under it; a 7 MB body of any shape is far over it.
INLINE_NS = 2_000_000
# More structure than this is refused: ~100 k containers or ~1 M values (a 1 M-token prompt
# of ids is 25 ms). Above it, two services would each hold their GIL for tens of ms per body.
MAX_STRUCTURE_NS = 30_000_000
# Below this size a body is never counted: its parse is at most ~2 ms whatever its shape.
COUNT_FROM = 16 * 1024


# Every byte but those counted: `bytes.translate` deletes them in one C pass (~0.35 ns a
# byte), leaving only `{`, `[` and `,`; three `bytes.count` passes take twice as long.
_NOT_COUNTED = bytes(b for b in range(256) if b not in b"{[,")


def counts(body: bytes) -> tuple[int, int]:
    """(containers, values): the `{` and `[`, and the `,` of `body`."""
    left = body.translate(None, _NOT_COUNTED)
    values = left.count(b",")
    return len(left) - values, values


def structure_ns(body: bytes) -> int:
    """The part of the estimate that the body's shape costs (containers and values)."""
    containers, values = counts(body)
    return containers * NS_PER_CONTAINER + values * NS_PER_VALUE


def cost_ns(body: bytes) -> int:
    """The estimated parse of `body`, in nanoseconds of one core (bytes and shape)."""
    return len(body) * NS_PER_BYTE + structure_ns(body)


def parses_inline(body: bytes) -> bool:
    """Whether `body` is cheap enough to parse on an event loop (`cost_ns` <= `INLINE_NS`);
    a body too big to be is answered without counting it."""
    if len(body) <= COUNT_FROM:
        return True
    if len(body) * NS_PER_BYTE > INLINE_NS:
        return False
    return cost_ns(body) <= INLINE_NS


def too_complex(body: bytes, limit_ns: int = MAX_STRUCTURE_NS) -> PayloadTooLarge | None:
    """The refusal of a body with more structure than `limit_ns`, else None. (Counts the
    body: run it in a screen, or where the body will be parsed on the loop anyway.)"""
    if len(body) <= COUNT_FROM:
        return None
    containers, values = counts(body)
    if containers * NS_PER_CONTAINER + values * NS_PER_VALUE <= limit_ns:
        return None
    return PayloadTooLarge(
        f"The request body holds about {containers:,} JSON objects and arrays and "
        f"{values:,} values: more structure than areal parses for one request (at most "
        f"about {limit_ns // NS_PER_CONTAINER:,} objects and arrays, or "
        f"{limit_ns // NS_PER_VALUE:,} values). Send fewer items (empty content "
        "blocks, unused metadata), or split the request.",
        code="body_too_complex",
    )
