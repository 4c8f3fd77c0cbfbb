"""A streamed chat choice's content chunks as bytes from a template made once per choice.

Every content chunk of one choice is the same JSON but for the text: id, created, model,
index, `logprobs: null`, `finish_reason: null`. Building the dict (`openai_response.
chat_chunk`) and encoding it for every token was most of the proxy's own per-token work
after the engine read; here the bytes around the text are encoded once, and a token costs
one encode of its text and a join. The output is byte for byte what `orjson.dumps(chat_chunk
(...))` gives (the tests compare them)."""

from __future__ import annotations

import orjson

from areal_proxy.output import openai_response as out

# Stands for the text while the template is made; split out of the encoded chunk after.
_MARK = "\x00areal-content\x00"
_MARK_JSON = orjson.dumps(_MARK)


class ContentChunks:
    """The content chunks (`{"content": text}` delta, no logprobs, not finished) of one
    streamed chat choice."""

    __slots__ = ("_head", "_tail")

    def __init__(
        self, *, rid: str, created: int, model: str, index: int, with_usage_field: bool
    ) -> None:
        encoded = orjson.dumps(
            out.chat_chunk(
                rid=rid,
                created=created,
                model=model,
                delta={"content": _MARK},
                with_usage_field=with_usage_field,
                index=index,
            )
        )
        # The delta comes after every field a caller names (id, model): the last mark is it.
        head, tail = encoded.rsplit(_MARK_JSON, 1)
        self._head = head
        self._tail = tail

    def content(self, text: str) -> bytes:
        return b"".join((self._head, orjson.dumps(text), self._tail))
