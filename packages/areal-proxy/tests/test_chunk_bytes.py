"""Templated content chunks are byte for byte the chunks the dict path encodes."""

from __future__ import annotations

import orjson
import pytest

from areal_proxy.output import openai_response as out
from areal_proxy.output.chunk_bytes import ContentChunks


@pytest.mark.parametrize("usage_field", [False, True])
@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize(
    "text", ["", " hi", 'a "quoted"\n\ttab\\', "\u00e9\u4e2d\U0001f600", "\x00areal-content\x00"]
)
def test_template_matches_the_dict_encoding(usage_field: bool, index: int, text: str) -> None:
    # A model named like the template's mark still gets its own name back.
    for model in ("tiny", "\x00areal-content\x00"):
        fields = {"rid": "chatcmpl-x", "created": 17, "model": model, "index": index}
        chunks = ContentChunks(**fields, with_usage_field=usage_field)
        want = orjson.dumps(
            out.chat_chunk(**fields, delta={"content": text}, with_usage_field=usage_field)
        )
        assert chunks.content(text) == want
