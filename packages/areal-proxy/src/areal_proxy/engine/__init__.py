"""Clients for the inference engines a data proxy sits in front of."""

from areal_proxy.engine.base import (
    EngineClient,
    EngineError,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
)

__all__ = [
    "EngineClient",
    "EngineError",
    "GenerationChunk",
    "GenerationRequest",
    "GenerationResult",
]
