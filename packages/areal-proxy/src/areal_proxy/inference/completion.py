"""`/v1/completions`, whole and streamed: how a completion's answer is written (its echo,
its logprobs' text offsets); the serving path itself is the core's (core.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.inference.core import InferenceCore
from areal_proxy.inference.pipeline import Piece
from areal_proxy.inference.prepared import Answer, Prepared
from areal_proxy.output import openai_response as out
from areal_runtime.openai import CompletionRequest


async def whole(
    core: InferenceCore, body: bytes, env: Envelope | None = None
) -> tuple[bytes, GenerationRecord]:
    req, p = await core.prelude.completion(body, env, out.response_id("cmpl"))
    return await core.whole(Completion(core, req, p), p)


async def stream(
    core: InferenceCore, body: bytes, env: Envelope | None = None
) -> AsyncGenerator[bytes, None]:
    req, p = await core.prelude.completion(body, env, out.response_id("cmpl"))
    async with aclosing(core.stream(Completion(core, req, p), p)) as chunks:
        async for chunk in chunks:
            yield chunk


class Completion:
    """The completions endpoint of one request (core.Endpoint): plain text, no parsers."""

    whole_object = "text_completion"
    chunk_object = "text_completion"
    parser = None
    one_call = False

    def __init__(self, core: InferenceCore, req: CompletionRequest, p: Prepared) -> None:
        self.core = core
        self.req = req
        self.p = p
        self.sampling = req.sampling
        self.include_usage = req.include_usage

    def echo(self, i: int) -> str:
        """Prompt i's text as `echo` puts it before the answer ("" without echo)."""
        req = self.req
        if not req.echo:
            return ""
        source = req.prompts[i]
        if isinstance(source, str):
            return source
        tok = self.core.tok
        return tok.decode(self.p.prompts[i], skip_special_tokens=req.sampling.skip_special_tokens)

    def recorded(self, k: int, a: Answer) -> tuple[str, str]:
        # A prompt of token ids records no prompt text.
        source = self.req.prompts[self.p.recs[k][1]]
        return (source if isinstance(source, str) else ""), a.text

    def logprobs(self, ids: list[int], lps: list[float], tops: Any, offset: int) -> Any:
        return out.completion_logprobs(
            self.core.tok, ids, lps, tops, with_top=(self.req.logprobs or 0) > 0, offset=offset
        )

    def choice(self, p: Prepared, k: int, a: Answer) -> dict[str, Any]:
        rec, i = p.recs[k]
        echo = self.echo(i)
        lp = None
        if self.req.logprobs is not None:
            lp = self.logprobs(rec.token_ids, rec.logprobs, rec.top_logprobs, len(echo))
        return {"index": k, "text": echo + a.text, "logprobs": lp, "finish_reason": a.finish}

    def stream_of(self, p: Prepared, k: int, created: int) -> CompletionChunks:
        return CompletionChunks(self, k, created, self.echo(p.recs[k][1]))


class CompletionChunks:
    """The chunks of one choice of a streamed completion: the echo goes with the first, the
    last step's text with the finish reason (after the answer is settled)."""

    __slots__ = ("_completion", "_created", "_index", "_last", "_offset", "_pending")

    def __init__(self, completion: Completion, index: int, created: int, echo: str) -> None:
        self._completion = completion
        self._index = index
        self._created = created
        self._pending = echo
        self._offset = len(echo)
        self._last: tuple[str, Any] = ("", None)

    def chunks(self, piece: Piece) -> list[bytes]:
        completion = self._completion
        step = piece.step
        ids = step.token_ids
        lp = None
        if completion.req.logprobs is not None and ids:
            lp = completion.logprobs(ids, step.logprobs, step.top_logprobs, self._offset)
            self._offset += sum(len(t) for t in lp["tokens"])
        text = self._pending + piece.text
        self._pending = ""
        if piece.finish_reason is not None:
            # Checked (and committed) before the finish reaches the client: held for `end`.
            self._last = (text, lp)
            return []
        if text or lp is not None:
            return [self._chunk(text, None, lp)]
        return []

    def end(self, piece: Piece) -> list[bytes]:
        text, lp = self._last
        return [self._chunk(text, piece.finish_reason, lp)]

    def _chunk(self, text: str, finish: str | None, lp: Any) -> bytes:
        completion = self._completion
        return orjson.dumps(
            out.completion_chunk(
                rid=completion.p.rid,
                created=self._created,
                model=completion.core.config.model,
                text=text,
                finish_reason=finish,
                logprobs=lp,
                with_usage_field=completion.include_usage,
                index=self._index,
            )
        )
