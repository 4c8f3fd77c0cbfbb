"""The inference core: one serving path for every OpenAI generation request, whole and
streamed, chat and completion. It wires the parts, each with one job (prelude.py prepares
the request and starts its generations, pipeline.py turns each choice's output into the
client's text, commit.py checks and records a finished answer), and runs them in order;
an endpoint (chat.py, completion.py) only says how its request reads and its answer is
written. Nothing here knows about gRPC."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Executor
from contextlib import aclosing
from typing import Any, Protocol

import orjson

from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.engine.base import EngineError
from areal_proxy.generation.controller import GenerationController, GenerationRecord
from areal_proxy.inference.choices import all_of, merged
from areal_proxy.inference.commit import Commit, needed
from areal_proxy.inference.limits import ContextLimits
from areal_proxy.inference.pipeline import Piece, TextPipeline
from areal_proxy.inference.prelude import Prelude
from areal_proxy.inference.prepared import Answer, InferenceConfig, Prepared
from areal_proxy.inference.refusal import refused
from areal_proxy.output import openai_response as out
from areal_proxy.prompt.chat_template import PromptBuilder
from areal_proxy.prompt.incremental import Built, SessionPrompts
from areal_proxy.recording.recorder import Recorder
from areal_runtime.offload import Offload
from areal_runtime.openai import Sampling


class Chunks(Protocol):
    """One streamed choice's chunks, as its endpoint writes them."""

    def chunks(self, piece: Piece) -> list[bytes]:
        """A chunk per delta the piece adds, sent at once (before a last piece is settled)."""
        ...

    def end(self, piece: Piece) -> list[bytes]:
        """What follows the last piece once its answer is checked and committed."""
        ...


class Endpoint(Protocol):
    """What an endpoint adds to the serving path: how its request reads (sampling, output
    parsing) and how its answer is recorded and written."""

    sampling: Sampling
    # The request's OutputParser (None: plain text) and `parallel_tool_calls: false`.
    parser: Any | None
    one_call: bool
    include_usage: bool
    whole_object: str
    chunk_object: str

    def recorded(
        self, k: int, a: Answer
    ) -> tuple[list[dict[str, Any]] | str, dict[str, Any] | str]:
        """Choice `k`'s interaction as recorded: (its prompt, its answer)."""
        ...

    def choice(self, p: Prepared, k: int, a: Answer) -> dict[str, Any]:
        """Choice `k` of a whole response."""
        ...

    def stream_of(self, p: Prepared, k: int, created: int) -> Chunks: ...


class InferenceCore:
    def __init__(
        self,
        config: InferenceConfig,
        tok: ModelTokenizer,
        prompts: PromptBuilder | None,
        controller: GenerationController,
        *,
        session_prompts: SessionPrompts | None = None,
        recorder: Recorder | None = None,
        executor: Executor | None = None,
        screen: Offload | None = None,
        on_prompt: Callable[[Built], None] | None = None,
    ) -> None:
        """`config` as the server resolved it (its tool-call parser chosen, prompts' template
        told that parser, the recorder given the same session prompts)."""
        self.config = config
        self.tok = tok
        self.prompts = prompts
        self.controller = controller
        # The template ignores `tools` and the proxy writes them in (tool_prompt.py); GetStats
        # says so, and `areal inf status` shows how tools reach this model.
        self.default_tool_prompt = prompts is not None and prompts.template.writes_tool_prompt
        self.limits = ContextLimits(
            config.context_length or tok.context_length,
            config.engine_max_tokens,
            getattr(controller.engine, "context_limit", None),
        )
        self.prelude = Prelude(
            config,
            tok,
            prompts,
            session_prompts,
            controller,
            self.limits,
            recorder,
            executor,
            screen,
            on_prompt,
        )
        self.commit = Commit(recorder)

    @property
    def context_length(self) -> int:
        return self.limits.context_length

    async def learn_engine_limit(self, reconnected: bool) -> None:
        await self.limits.learn(reconnected)

    # ---- whole answers -------------------------------------------------------------

    async def whole(self, ep: Endpoint, p: Prepared) -> tuple[bytes, GenerationRecord]:
        """Every choice generated whole (the engine's non-streamed call), its text run through
        the pipeline as one piece, checked and committed, then the response."""
        try:
            await all_of(self._generate(p, rec, i) for rec, i in p.recs)
        finally:
            self.finish(p)
        answers = [
            (k, self._pipeline(ep, p, rec, keep=True).whole()) for k, (rec, _) in enumerate(p.recs)
        ]
        await self.commit.settle(p, answers, ep.recorded)
        body = out.whole_response(
            obj=ep.whole_object,
            rid=p.rid,
            created=int(time.time()),
            model=self.config.model,
            choices=[ep.choice(p, k, a) for k, a in answers],
            usage_=p.usage(),
        )
        return orjson.dumps(body), p.recs[0][0]

    async def _generate(self, p: Prepared, rec: GenerationRecord, i: int) -> None:
        try:
            await self.controller.generate(rec, p.template)
        except EngineError as e:
            if not e.refused:
                raise
            raise refused(e, p.prompt_param(i), p.constraint_param) from None

    # ---- streamed answers ----------------------------------------------------------

    async def stream(self, ep: Endpoint, p: Prepared) -> AsyncGenerator[bytes, None]:
        """Every choice's chunks as they come, then the usage chunk when asked for; the
        generations are finished however the stream ends."""
        created = int(time.time())
        streams = [self._choice(ep, p, k, created) for k in range(len(p.recs))]
        try:
            async with aclosing(merged(streams)) as chunks:
                async for chunk in chunks:
                    yield chunk
            if ep.include_usage:
                yield orjson.dumps(
                    out.usage_chunk(
                        rid=p.rid,
                        created=created,
                        model=self.config.model,
                        obj=ep.chunk_object,
                        usage_=p.usage(),
                    )
                )
        finally:
            self.finish(p)

    async def _choice(
        self, ep: Endpoint, p: Prepared, k: int, created: int
    ) -> AsyncGenerator[bytes, None]:
        """One choice's chunks: a piece per engine step; the last settled before its end."""
        rec, i = p.recs[k]
        settled = needed(p)
        pipe = self._pipeline(ep, p, rec, keep=settled)
        writer = ep.stream_of(p, k, created)
        piece: Piece | None = None
        try:
            async with aclosing(self.controller.stream(rec, p.template)) as steps:
                async for step in steps:
                    piece = pipe.feed(step)
                    for chunk in writer.chunks(piece):
                        yield chunk
                    if piece.finish_reason is not None:
                        break
        except EngineError as e:
            if not e.refused:
                raise
            raise refused(e, p.prompt_param(i), p.constraint_param) from None
        if piece is None or piece.finish_reason is None:
            return
        if settled:
            await self.commit.settle(p, [(k, pipe.answer())], ep.recorded)
        for chunk in writer.end(piece):
            yield chunk

    # ---- shared --------------------------------------------------------------------

    def _pipeline(
        self, ep: Endpoint, p: Prepared, rec: GenerationRecord, *, keep: bool
    ) -> TextPipeline:
        return TextPipeline(
            self.tok,
            self.controller,
            rec,
            p.template,
            ep.sampling,
            ep.parser,
            one_call=ep.one_call,
            keep=keep,
        )

    def finish(self, p: Prepared) -> None:
        for rec, _ in p.recs:
            self.controller.finish(rec)
