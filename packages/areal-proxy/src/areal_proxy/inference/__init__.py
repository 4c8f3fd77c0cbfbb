"""One OpenAI request end to end, engine-neutral and gRPC-free.

core.py is the one serving path every generation request takes, whole or streamed: the
prelude (prelude.py: screen, parse, the session's turn, the prompt, the budget, the
generations), the text pipeline (pipeline.py: each choice's output as the client's text),
the commit (commit.py: check, then record, then answer); chat.py and completion.py say how
their endpoint's requests read and answers are written."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.inference import chat, completion, count
from areal_proxy.inference.core import InferenceCore
from areal_proxy.inference.limits import FALLBACK_MAX_TOKENS
from areal_proxy.inference.prepared import InferenceConfig

__all__ = ["FALLBACK_MAX_TOKENS", "InferenceConfig", "InferenceHandler"]


class InferenceHandler(InferenceCore):
    """The four generation RPCs' handlers, and CountTokens'."""

    async def chat(
        self, body: bytes, env: Envelope | None = None
    ) -> tuple[bytes, GenerationRecord]:
        return await chat.whole(self, body, env)

    def chat_stream(self, body: bytes, env: Envelope | None = None) -> AsyncGenerator[bytes, None]:
        return chat.stream(self, body, env)

    async def completion(
        self, body: bytes, env: Envelope | None = None
    ) -> tuple[bytes, GenerationRecord]:
        return await completion.whole(self, body, env)

    def completion_stream(
        self, body: bytes, env: Envelope | None = None
    ) -> AsyncGenerator[bytes, None]:
        return completion.stream(self, body, env)

    async def count_tokens(self, body: bytes) -> int:
        return await count.count_tokens(self, body)
