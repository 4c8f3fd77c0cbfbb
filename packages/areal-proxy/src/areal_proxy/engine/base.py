"""The engine-neutral shape of token generation.

The proxy works in token ids end to end; an engine client turns a
GenerationRequest into the engine's own API and the engine's answer back into
GenerationChunk / GenerationResult. Nothing above this layer knows which
engine it talks to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

# Longest run of whitespace a constrained JSON output may hold. A JSON grammar with free
# whitespace lets a weak policy (a small model sampled at temperature 1, as RL does) pad
# blanks until max_tokens and never close the object: measured on the CPU SGLang engine,
# `{"city":"Oslo"` and then 80 spaces. 4 leaves room for "key": value and an indented line.
JSON_MAX_WHITESPACE = 4


def bounded_json_tag(schema: str) -> str:
    """A JSON-schema constraint as an xgrammar structural tag with whitespace runs bounded
    (SGLang and vLLM both take it as `structural_tag`; their plain JSON constraint cannot
    bound whitespace)."""
    return orjson.dumps(
        {
            "type": "structural_tag",
            "format": {
                "type": "json_schema",
                "json_schema": orjson.loads(schema),
                "max_whitespace_cnt": JSON_MAX_WHITESPACE,
            },
        }
    ).decode()


def engine_constraint(constraint: tuple[str, str] | None) -> tuple[str, str] | None:
    """The constraint as the engine takes it: JSON schemas become bounded structural tags."""
    if constraint is not None and constraint[0] == "json_schema":
        return "structural_tag", bounded_json_tag(constraint[1])
    return constraint


class EngineError(Exception):
    """The engine could not be reached or answered with an error."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        retryable: bool = False,
        lost: bool = False,
        refused: str = "",
    ) -> None:
        super().__init__(message)
        self.status = status
        # Set when the engine refused the request itself as invalid (engine/refusals.py):
        # what of it, "prompt" (longer than the engine takes), "constraint" (a grammar it
        # cannot compile) or "request" (anything else); the client's error, never retried.
        self.refused = refused
        # True only when nothing was generated (connection refused before the
        # request was accepted): generation is never retried blindly.
        self.retryable = retryable
        # The engine died or became unreachable under the request (refused, reset, closed,
        # a stream ended without a finish): not an answer of the engine about the request,
        # which may therefore continue on another replica (migration). An engine's refusal
        # of the request itself (a 4xx, a bad grammar) is never `lost`.
        self.lost = lost


@dataclass(slots=True)
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int
    # `input_ids` as a JSON array, when the caller has it already (engine clients that send
    # JSON splice it in instead of encoding the ids again); None: encode them.
    input_ids_json: bytes | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0
    # Engine-side request id, so the request can be aborted by id.
    rid: str | None = None
    # Constrained decoding: (kind, value), kind one of json_schema, regex, ebnf,
    # structural_tag (SGLang's names; each client maps them to its engine's).
    constraint: tuple[str, str] | None = None
    # Sampling fields the caller passed that have no typed slot here; they are
    # forwarded to the engine as they came.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class GenerationChunk:
    """Tokens produced since the previous chunk of one streamed generation."""

    token_ids: list[int]
    logprobs: list[float]
    # Per token: [(token_id, logprob), ...] when top logprobs were asked for.
    top_logprobs: list[list[tuple[int, float]]]
    # Set on the last chunk: "stop", "length" or "abort".
    finish_reason: str | None = None
    # The stop token that ended generation, if any (it is part of token_ids).
    matched_stop: int | None = None
    prompt_tokens: int = 0
    weight_version: str = ""
    # Who generated these tokens: "" for this proxy's own engine, else the proxy id of the
    # replica a migrated request continues on.
    replica: str = ""


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str
    prompt_tokens: int
    weight_version: str = ""
    replica: str = ""


class EngineClient(Protocol):
    """What the proxy needs from an engine."""

    base_url: str

    async def health(self) -> bool | None:
        """True: healthy; False: refused the connection or answered a failure; None: no
        answer within the probe's timeout (a busy engine as well as a hung one: the proxy's
        engine/progress.py tells them apart)."""
        ...

    async def generate(self, req: GenerationRequest) -> GenerationResult: ...

    def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]: ...

    async def abort(self, rid: str | None = None) -> None: ...

    async def close(self) -> None: ...


def collect(chunks: list[GenerationChunk]) -> GenerationResult:
    """Join the chunks of one streamed generation into a result."""
    ids: list[int] = []
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    finish, prompt, version = "abort", 0, ""
    for c in chunks:
        ids.extend(c.token_ids)
        lps.extend(c.logprobs)
        tops.extend(c.top_logprobs)
        prompt = c.prompt_tokens or prompt
        version = c.weight_version or version
        if c.finish_reason:
            finish = c.finish_reason
    return GenerationResult(ids, lps, tops, finish, prompt, version)
