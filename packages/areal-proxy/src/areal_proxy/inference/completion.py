"""`/v1/completions`, whole and streamed, over the prompt-and-record core."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import orjson

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.inference.core import InferenceCore, Prepared, usage
from areal_proxy.output import openai_response as out
from areal_proxy.recording.recorder import OpenTurn
from areal_runtime.openai import CompletionRequest


def _echo(core: InferenceCore, req: CompletionRequest, p: Prepared, i: int) -> str:
    if not req.echo:
        return ""
    source = req.prompts[i]
    if isinstance(source, str):
        return source
    return core.tok.decode(p.prompts[i], skip_special_tokens=req.sampling.skip_special_tokens)


def _source_text(source: str | list[int]) -> str:
    """What a completions interaction records as its prompt text ("" for token ids)."""
    return source if isinstance(source, str) else ""


async def whole(
    core: InferenceCore, body: bytes, env: Envelope | None = None
) -> tuple[bytes, GenerationRecord]:
    req, p = await core.prepare_completion(body, env, out.response_id("cmpl"))
    try:
        await core.generate_all(p)
    finally:
        core.finish(p)
    top = req.logprobs or 0
    finals = [core.final_text(rec, p.template, req.sampling) for rec, _ in p.recs]
    for text, finish in finals:  # every choice checked before any is recorded
        core.check_json(p, text, finish)
    choices = []
    for k, (rec, i) in enumerate(p.recs):
        text, finish = finals[k]
        echo = _echo(core, req, p, i)
        await core.commit(p.turn_of(k), _source_text(req.prompts[i]), text, rec, finish)
        lp = (
            out.completion_logprobs(
                core.tok,
                rec.token_ids,
                rec.logprobs,
                rec.top_logprobs,
                with_top=top > 0,
                offset=len(echo),
            )
            if req.logprobs is not None
            else None
        )
        choices.append({"index": k, "text": echo + text, "logprobs": lp, "finish_reason": finish})
    body_out = out.whole_response(
        obj="text_completion",
        rid=p.rid,
        created=int(time.time()),
        model=core.config.model,
        choices=choices,
        usage_=usage(p.recs),
    )
    return orjson.dumps(body_out), p.recs[0][0]


async def stream(
    core: InferenceCore, body: bytes, env: Envelope | None = None
) -> AsyncGenerator[bytes, None]:
    req, p = await core.prepare_completion(body, env, out.response_id("cmpl"))
    created = int(time.time())
    streams = [
        _choice_stream(core, req, p, rec, p.turn_of(k), _echo(core, req, p, i), i, created, k)
        for k, (rec, i) in enumerate(p.recs)
    ]
    obj = "text_completion"
    async with aclosing(core.stream_choices(p, streams, created, obj, req.include_usage)) as s:
        async for chunk in s:
            yield chunk


async def _choice_stream(
    core: InferenceCore,
    req: CompletionRequest,
    p: Prepared,
    rec: GenerationRecord,
    ot: OpenTurn | None,
    echo: str,
    prompt_index: int,
    created: int,
    index: int,
) -> AsyncGenerator[bytes, None]:
    top = req.logprobs or 0
    model = core.config.model
    source = _source_text(req.prompts[prompt_index])
    texts: list[str] = []
    pending = echo
    offset = len(pending)
    usage_field = req.include_usage
    async with aclosing(core.text_steps(p, rec, prompt_index, req.sampling)) as steps:
        async for ts in steps:
            ids = ts.step.token_ids
            lp = None
            if req.logprobs is not None and ids:
                lp = out.completion_logprobs(
                    core.tok,
                    ids,
                    ts.step.logprobs,
                    ts.step.top_logprobs,
                    with_top=top > 0,
                    offset=offset,
                )
                offset += sum(len(t) for t in lp["tokens"])
            text = pending + ts.text
            pending = ""
            if ot is not None or p.schema is not None:
                texts.append(ts.text)
            if ts.finish_reason is not None:
                # Checked before the finish reaches the client (its text may have gone).
                core.check_json(p, "".join(texts), ts.finish_reason)
                if ot is not None:
                    await core.commit(ot, source, "".join(texts), rec, ts.finish_reason)
            if text or lp is not None or ts.finish_reason is not None:
                yield orjson.dumps(
                    out.completion_chunk(
                        rid=p.rid,
                        created=created,
                        model=model,
                        text=text,
                        finish_reason=ts.finish_reason,
                        logprobs=lp,
                        with_usage_field=usage_field,
                        index=index,
                    )
                )
