"""One OpenAI request end to end, engine-neutral and gRPC-free.

core.py is the prompt-and-record core every request goes through (screen, parse, the
session's turn, the prompt, the budget, the generations, the commit); chat.py and
completion.py shape the requests and responses of their endpoints over it."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.inference import chat, completion, count
from areal_proxy.inference.core import FALLBACK_MAX_TOKENS, InferenceConfig, InferenceCore

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
