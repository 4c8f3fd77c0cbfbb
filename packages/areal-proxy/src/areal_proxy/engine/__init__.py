"""Clients for the inference engines a data proxy sits in front of."""

from __future__ import annotations

from areal_proxy.engine.base import (
    EngineClient,
    EngineError,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
)

ENGINE_KINDS = ("sglang", "vllm")


def make_engine_client(kind: str, url: str, timeout: float | None = None) -> EngineClient:
    """The client for `--engine kind` (vLLM's module is imported only when asked for)."""
    if kind == "sglang":
        from areal_proxy.engine.sglang import SGLangClient

        return SGLangClient(url, timeout=timeout)
    if kind == "vllm":
        from areal_proxy.engine.vllm import VLLMClient

        return VLLMClient(url, timeout=timeout)
    raise ValueError(f"unknown engine {kind!r} (expected one of {', '.join(ENGINE_KINDS)})")


__all__ = [
    "ENGINE_KINDS",
    "EngineClient",
    "EngineError",
    "GenerationChunk",
    "GenerationRequest",
    "GenerationResult",
    "make_engine_client",
]
