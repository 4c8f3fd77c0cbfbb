"""An engine's refusal of a request (EngineError.refused) as the client's 400, naming the
request field to change; the engine's own words follow, cleaned (engine/refusals.py)."""

from __future__ import annotations

from areal_proxy.engine import refusals
from areal_proxy.engine.base import EngineError
from areal_runtime.errors import InvalidRequest
from areal_runtime.openai import bad


def refused(e: EngineError, prompt_param: str, constraint_param: str) -> InvalidRequest:
    if e.refused == refusals.PROMPT:
        return bad(
            f"the engine serving this model refused the prompt as too long ({e}); "
            f"shorten '{prompt_param}'",
            prompt_param,
            "context_length_exceeded",
        )
    if e.refused == refusals.CONSTRAINT:
        return bad(
            f"the engine cannot compile '{constraint_param}' into a grammar ({e}); fix it "
            "(a JSON schema's types are object, array, string, number, integer, boolean "
            "and null)",
            constraint_param,
        )
    return bad(f"the engine refused the request: {e}", None)
