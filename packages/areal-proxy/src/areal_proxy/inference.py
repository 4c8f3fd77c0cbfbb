"""One OpenAI request end to end, engine-neutral and gRPC-free: validate, build the prompt,
generate (through GenerationController), and produce response bodies / stream chunks."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import orjson

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy import openai_response as out
from areal_proxy.chat_template import PromptBuilder, PromptTooLong, TemplateError
from areal_proxy.engine.base import GenerationRequest
from areal_proxy.forced_tools import forced_constraint
from areal_proxy.generation import GenerationController, GenerationRecord, Step
from areal_proxy.openai_request import (
    ChatRequest,
    CompletionRequest,
    Sampling,
    bad,
    parse_chat,
    parse_completion,
)
from areal_proxy.output_parsing import (
    collect_events,
    delta_dicts,
    first_call_only,
    make_output_parser,
)
from areal_proxy.recorder import OpenTurn, Recorder
from areal_proxy.screen import CHAT as SCREEN_CHAT
from areal_proxy.screen import COMPLETION as SCREEN_COMPLETION
from areal_proxy.screen import SCREEN_MIN_BODY
from areal_proxy.stop_strings import StopChecker, truncate_at_stop
from areal_proxy.tokenizer import ModelTokenizer
from areal_runtime.errors import InvalidRequest
from areal_runtime.offload import Offload, OffloadFailed

# max_tokens when neither the request nor the model says how long an answer may be.
FALLBACK_MAX_TOKENS = 4096

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class InferenceConfig:
    model: str
    context_length: int = 0
    engine_max_tokens: int = 0
    tool_call_parser: str = ""
    reasoning_parser: str = ""


@dataclass(slots=True)
class TextStep:
    """A generation step with the text the client may see for it."""

    text: str
    step: Step
    finish_reason: str | None


class InferenceHandler:
    def __init__(
        self,
        config: InferenceConfig,
        tok: ModelTokenizer,
        prompts: PromptBuilder | None,
        controller: GenerationController,
        recorder: Recorder | None = None,
        executor: Executor | None = None,
        screen: Offload | None = None,
    ) -> None:
        self.recorder = recorder
        self.config = config
        self.tok = tok
        self.prompts = prompts
        self.controller = controller
        self.context_length = config.context_length or tok.context_length
        # Where templating and tokenizing run (None: inline, for tests): never on the event
        # loop, which must keep serving the other requests, health and GetStats while a
        # prompt of megabytes takes seconds (the tokenizers library releases the GIL while
        # it encodes, so the loop runs meanwhile).
        self.executor = executor
        # Huge bodies are first shown to a child process that refuses a prompt the context
        # cannot hold, without this process touching the body (screen.py).
        self.screen = screen

    async def _screened(self, kind: bytes, body: bytes) -> None:
        """Refuse a huge body whose prompt cannot fit, on the screen's word; anything else
        (and a screen that failed) goes on to this proxy's own checks."""
        if self.screen is None or len(body) <= SCREEN_MIN_BODY or not self.context_length:
            return
        try:
            answer = orjson.loads(await self.screen.call(kind, body))
        except OffloadFailed as exc:
            log.warning("prompt screen: %s; checking the prompt here", exc)
            return
        if "tokens" in answer:
            raise self._too_long(answer["tokens"], answer["param"], at_least=not answer["exact"])

    async def _off_loop(self, heavy: bool, fn: Callable[..., _T], /, *args: Any) -> _T:
        """`fn(*args)` on the executor when `heavy`; a small prompt costs less than the hop."""
        if self.executor is None or not heavy:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    def _too_long(self, tokens: int, param: str, *, at_least: bool = False) -> InvalidRequest:
        return bad(
            f"the prompt is {'at least ' if at_least else ''}{tokens} tokens; "
            f"this model's context length is {self.context_length}",
            param,
            "context_length_exceeded",
        )

    # ---- request preparation -----------------------------------------------------------

    def _budget(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        ctx = self.context_length
        if ctx and prompt_len >= ctx:
            raise self._too_long(prompt_len, prompt_param)
        budget = (
            requested
            if requested is not None
            else (ctx - prompt_len if ctx else FALLBACK_MAX_TOKENS)
        )
        if self.config.engine_max_tokens > 0:
            budget = min(budget, self.config.engine_max_tokens)
        if ctx:
            budget = min(budget, ctx - prompt_len)
        return budget

    def _template(self, s: Sampling, top_logprobs: int) -> GenerationRequest:
        stop_ids = list(s.stop_token_ids)
        if not s.ignore_eos:
            stop_ids.extend(t for t in self.tok.eos_token_ids if t not in stop_ids)
        return GenerationRequest(
            input_ids=[],
            max_new_tokens=0,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            repetition_penalty=s.repetition_penalty,
            stop_token_ids=stop_ids,
            ignore_eos=s.ignore_eos,
            seed=s.seed,
            top_logprobs=top_logprobs,
            extra=s.extra,
            constraint=(s.constraint.kind, s.constraint.value) if s.constraint else None,
        )

    def _prompts(self) -> PromptBuilder:
        if self.prompts is None:
            raise bad("this model has no chat template; use /v1/completions", "messages")
        return self.prompts

    def chat_text(self, req: ChatRequest) -> str:
        """The rendered conversation, refused if its length alone rules out the context."""
        try:
            return self._prompts().render_checked(
                req.messages, req.tools, req.template_kwargs, self.context_length
            )
        except PromptTooLong as e:
            raise self._too_long(e.tokens, "messages", at_least=not e.exact) from None
        except TemplateError as e:
            raise bad(str(e), "messages", "chat_template_error") from None

    def chat_prompt(
        self, req: ChatRequest, ot: OpenTurn | None = None, rendered: str | None = None
    ) -> list[int]:
        prompts = self._prompts()
        try:
            return prompts.prompt_ids(
                req.messages,
                req.tools,
                req.template_kwargs,
                previous_ids=ot.previous_ids if ot is not None else None,
                previous_messages=ot.turn.covered if ot is not None else 0,
                limit=self.context_length,
                rendered=rendered,
            )
        except PromptTooLong as e:
            raise self._too_long(e.tokens, "messages", at_least=not e.exact) from None
        except TemplateError as e:
            raise bad(str(e), "messages", "chat_template_error") from None

    async def _chat_turn(
        self, body: bytes, req: ChatRequest, env: Envelope | None, rid: str
    ) -> tuple[OpenTurn | None, list[int]]:
        """The open turn and the prompt ids of a chat request. A big body is rendered and
        checked against the context first (off the loop): a prompt that cannot fit is
        refused before its turn is looked up (the lineage hashes every message) and before
        it is tokenized, the costs that grow with its size."""
        rendered = None
        if len(body) > _INLINE_BODY_BYTES:
            rendered = await self._off_loop(True, self.chat_text, req)
        ot = await self._begin(env, req.messages, rid)
        prompt = await self._off_loop(_heavy(body, ot), self.chat_prompt, req, ot, rendered)
        return ot, prompt

    def completion_prompt(self, req: CompletionRequest, param: str = "prompt") -> list[int]:
        if req.prompt_ids is not None:
            return req.prompt_ids
        text = req.prompt_text or ""
        ctx = self.context_length
        if ctx and (n := self.tok.min_tokens(text)) >= ctx:
            raise self._too_long(n, param, at_least=True)
        try:
            ids = self.tok.encode(text, add_special_tokens=True, limit=ctx)
        except PromptTooLong as e:
            raise self._too_long(e.tokens, param) from None
        if not ids:
            raise bad(f"'{param}' encodes to no tokens", param)
        return ids

    def _visible_ids(self, ids: list[int], finish: str | None, stop_ids: list[int]) -> list[int]:
        """Output ids whose text the client sees: without the stop token that ended them."""
        if finish == "stop" and ids and ids[-1] in stop_ids:
            return ids[:-1]
        return ids

    # ---- streaming text ----------------------------------------------------------------

    async def _text_steps(
        self, rec: GenerationRecord, template: GenerationRequest, s: Sampling
    ) -> AsyncGenerator[TextStep, None]:
        detok = self.tok.detokenizer(skip_special_tokens=s.skip_special_tokens)
        stopper = StopChecker(s.stop) if s.stop else None
        stop_ids = template.stop_token_ids
        async with aclosing(self.controller.stream(rec, template)) as steps:
            async for step in steps:
                finish = step.finish_reason
                ids = self._visible_ids(step.token_ids, finish, stop_ids)
                text = detok.feed(ids) if ids else ""
                if finish is not None:
                    text += detok.flush()
                if stopper is not None:
                    text, hit = stopper.feed(text)
                    if hit:
                        if rec.finish_reason is None:
                            self.controller.abort_later(rec.engine_rid)
                        rec.finish_reason = finish = "stop"
                    elif finish is not None:
                        text += stopper.flush()
                yield TextStep(text, step, finish)
                if finish is not None:
                    return

    def _final_text(
        self, rec: GenerationRecord, template: GenerationRequest, s: Sampling
    ) -> tuple[str, str]:
        finish = rec.finish_reason or "abort"
        ids = self._visible_ids(rec.token_ids, finish, template.stop_token_ids)
        text = self.tok.decode(ids, skip_special_tokens=s.skip_special_tokens)
        if s.stop:
            text, hit = truncate_at_stop(text, s.stop)
            if hit:
                finish = "stop"
        return text, finish

    # ---- chat --------------------------------------------------------------------------

    async def _begin(
        self, env: Envelope | None, messages: list[dict[str, Any]] | None, rid: str
    ) -> OpenTurn | None:
        if self.recorder is None:
            return None
        return await self.recorder.begin(env, messages, rid)

    async def _commit(
        self,
        ot: OpenTurn | None,
        messages: list[dict[str, Any]] | str,
        response: dict[str, Any] | str,
        rec: GenerationRecord,
        finish: str,
    ) -> None:
        if ot is not None and self.recorder is not None:
            await self.recorder.commit(
                ot, messages=messages, response=response, rec=rec, finish_reason=finish
            )

    def _chat_template(self, req: ChatRequest) -> GenerationRequest:
        template = self._template(req.sampling, req.top_logprobs)
        forced = forced_constraint(
            self.config.tool_call_parser,
            self.config.reasoning_parser,
            req.tools,
            req.tool_choice,
            req.parallel_tool_calls,
        )
        if forced is not None:
            if template.constraint is not None:
                raise bad(
                    "a forced 'tool_choice' and a constrained 'response_format' cannot both "
                    "hold the output",
                    "tool_choice",
                )
            template.constraint = (forced.kind, forced.value)
        return template

    def _output_parser(self, req: ChatRequest) -> Any | None:
        return make_output_parser(
            self.config.tool_call_parser if req.parse_tools else "",
            self.config.reasoning_parser,
            req.tools,
        )

    async def chat(
        self, body: bytes, env: Envelope | None = None
    ) -> tuple[bytes, GenerationRecord]:
        await self._screened(SCREEN_CHAT, body)
        req = parse_chat(body)
        rid = out.response_id("chatcmpl")
        ot, prompt = await self._chat_turn(body, req, env, rid)
        template = self._chat_template(req)
        budget = self._budget(len(prompt), req.sampling.max_tokens, "messages")
        n = req.sampling.n
        recs = [self.controller.start(prompt, budget) for _ in range(n)]
        try:
            await _all(self.controller.generate(rec, template) for rec in recs)
        finally:
            for rec in recs:
                self.controller.finish(rec)
        choices = []
        for i, rec in enumerate(recs):
            text, finish = self._final_text(rec, template, req.sampling)
            content: str | None = text
            reasoning: str | None = None
            calls: list[dict[str, Any]] | None = None
            parser = self._output_parser(req)
            if parser is not None:
                parsed = parser.parse(text)
                content, reasoning = parsed.content, parsed.reasoning_content
                calls = [
                    out.tool_call(c.id, c.name, c.arguments) for c in parsed.tool_calls
                ] or None
                if calls and not req.parallel_tool_calls:
                    calls = calls[:1]
                if calls and finish == "stop":
                    finish = "tool_calls"
            lp = (
                out.chat_logprobs(self.tok, rec.token_ids, rec.logprobs, rec.top_logprobs)
                if req.logprobs
                else None
            )
            await self._commit(
                _choice_turn(ot, rid, i, n),
                req.messages,
                _assistant(content, reasoning, calls),
                rec,
                finish,
            )
            choices.append(
                {
                    "index": i,
                    "message": out.chat_message(content, reasoning, calls),
                    "logprobs": lp,
                    "finish_reason": finish,
                }
            )
        body_out = out.whole_response(
            obj="chat.completion",
            rid=rid,
            created=int(time.time()),
            model=self.config.model,
            choices=choices,
            usage_=_usage(recs),
        )
        return orjson.dumps(body_out), recs[0]

    async def chat_stream(
        self, body: bytes, env: Envelope | None = None
    ) -> AsyncGenerator[bytes, None]:
        await self._screened(SCREEN_CHAT, body)
        req = parse_chat(body)
        rid = out.response_id("chatcmpl")
        ot, prompt = await self._chat_turn(body, req, env, rid)
        template = self._chat_template(req)
        budget = self._budget(len(prompt), req.sampling.max_tokens, "messages")
        n = req.sampling.n
        recs = [self.controller.start(prompt, budget) for _ in range(n)]
        created = int(time.time())
        try:
            streams = [
                self._chat_choice_stream(
                    req, rec, template, _choice_turn(ot, rid, i, n), rid, created, i
                )
                for i, rec in enumerate(recs)
            ]
            async with aclosing(
                self._choices_stream(streams, recs, rid, created, "chat.completion.chunk", req)
            ) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            for rec in recs:
                self.controller.finish(rec)

    async def _choices_stream(
        self,
        streams: list[AsyncGenerator[bytes, None]],
        recs: list[GenerationRecord],
        rid: str,
        created: int,
        obj: str,
        req: ChatRequest | CompletionRequest,
    ) -> AsyncGenerator[bytes, None]:
        """Every choice's chunks as they come, then the usage chunk when asked for."""
        async with aclosing(_merged(streams)) as chunks:
            async for chunk in chunks:
                yield chunk
        if req.include_usage:
            yield orjson.dumps(
                out.usage_chunk(
                    rid=rid, created=created, model=self.config.model, obj=obj, usage_=_usage(recs)
                )
            )

    async def _chat_choice_stream(
        self,
        req: ChatRequest,
        rec: GenerationRecord,
        template: GenerationRequest,
        ot: OpenTurn | None,
        rid: str,
        created: int,
        index: int,
    ) -> AsyncGenerator[bytes, None]:
        """The chunks of one choice of a streamed chat."""
        parser = self._output_parser(req)
        streamer = parser.streamer() if parser is not None else None
        model = self.config.model
        texts: list[str] = []
        # The parser events as streamed, so the recorded message has the tool call ids the
        # client got (parsing the text again would mint new ones).
        events: list[Any] = []
        usage_field = req.include_usage
        first = True
        async with aclosing(self._text_steps(rec, template, req.sampling)) as steps:
            async for ts in steps:
                if ot is not None:
                    texts.append(ts.text)
                if streamer is not None:
                    raw = streamer.feed(ts.text) if ts.text else []
                    if ts.finish_reason is not None:
                        raw.extend(streamer.finish())
                    if not req.parallel_tool_calls:
                        raw = first_call_only(raw)
                    if ot is not None:
                        events.extend(raw)
                    deltas = delta_dicts(raw)
                else:
                    deltas = [{"content": ts.text}] if ts.text else []
                ids = ts.step.token_ids
                lp = (
                    out.chat_logprobs(self.tok, ids, ts.step.logprobs, ts.step.top_logprobs)
                    if req.logprobs and ids
                    else None
                )
                if first:
                    first = False
                    if deltas:
                        deltas[0] = {"role": "assistant", **deltas[0]}
                    else:
                        deltas = [{"role": "assistant", "content": ""}]
                elif not deltas and lp is not None:
                    deltas = [{"content": ""}]
                for i, delta in enumerate(deltas):
                    yield orjson.dumps(
                        out.chat_chunk(
                            rid=rid,
                            created=created,
                            model=model,
                            delta=delta,
                            logprobs=lp if i == 0 else None,
                            with_usage_field=usage_field,
                            index=index,
                        )
                    )
                if ts.finish_reason is not None:
                    finish = ts.finish_reason
                    if finish == "stop" and streamer is not None and streamer.saw_tool_calls:
                        finish = "tool_calls"
                    if ot is not None:
                        # Committed before the client sees the end: acknowledged = durable.
                        await self._commit(
                            ot,
                            req.messages,
                            self._streamed_response("".join(texts), events, streamer),
                            rec,
                            finish,
                        )
                    yield orjson.dumps(
                        out.chat_chunk(
                            rid=rid,
                            created=created,
                            model=model,
                            delta={},
                            finish_reason=finish,
                            with_usage_field=usage_field,
                            index=index,
                        )
                    )

    def _streamed_response(self, text: str, events: list[Any], streamer: Any) -> dict[str, Any]:
        """The assistant message a stream sent: its parsed parts, as the client got them."""
        if streamer is None:
            return _assistant(text, None, None)
        parsed = collect_events(events)
        calls = [out.tool_call(c.id, c.name, c.arguments) for c in parsed.tool_calls] or None
        return _assistant(parsed.content, parsed.reasoning_content, calls)

    # ---- completions -------------------------------------------------------------------

    def _echo_text(self, req: CompletionRequest, prompt: list[int], source: str | list[int]) -> str:
        if not req.echo:
            return ""
        if isinstance(source, str):
            return source
        return self.tok.decode(prompt, skip_special_tokens=req.sampling.skip_special_tokens)

    async def _completion_prompts(
        self, body: bytes, req: CompletionRequest, ot: OpenTurn | None
    ) -> list[list[int]]:
        heavy = _heavy(body, ot)
        prompts = []
        for i, source in enumerate(req.prompts):
            one = replace(
                req,
                prompt_text=source if isinstance(source, str) else None,
                prompt_ids=source if not isinstance(source, str) else None,
            )
            param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            prompts.append(await self._off_loop(heavy, self.completion_prompt, one, param))
        return prompts

    def _completion_recs(
        self, req: CompletionRequest, prompts: list[list[int]]
    ) -> list[tuple[GenerationRecord, int]]:
        """One record per choice: prompt i's j-th sample is choice i * n + j (as OpenAI)."""
        n = req.sampling.n
        out_: list[tuple[GenerationRecord, int]] = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            budget = self._budget(len(prompt), req.sampling.max_tokens, param)
            out_.extend((self.controller.start(prompt, budget), i) for _ in range(n))
        return out_

    async def completion(
        self, body: bytes, env: Envelope | None = None
    ) -> tuple[bytes, GenerationRecord]:
        await self._screened(SCREEN_COMPLETION, body)
        req = parse_completion(body, vocab_size=self.tok.vocab_size)
        rid = out.response_id("cmpl")
        ot = await self._begin(env, None, rid)
        prompts = await self._completion_prompts(body, req, ot)
        top = req.logprobs or 0
        template = self._template(req.sampling, top)
        recs = self._completion_recs(req, prompts)
        try:
            await _all(self.controller.generate(rec, template) for rec, _ in recs)
        finally:
            for rec, _ in recs:
                self.controller.finish(rec)
        choices = []
        for k, (rec, i) in enumerate(recs):
            text, finish = self._final_text(rec, template, req.sampling)
            echo = self._echo_text(req, prompts[i], req.prompts[i])
            await self._commit(
                _choice_turn(ot, rid, k, len(recs)), _source_text(req.prompts[i]), text, rec, finish
            )
            lp = (
                out.completion_logprobs(
                    self.tok,
                    rec.token_ids,
                    rec.logprobs,
                    rec.top_logprobs,
                    with_top=top > 0,
                    offset=len(echo),
                )
                if req.logprobs is not None
                else None
            )
            choices.append(
                {"index": k, "text": echo + text, "logprobs": lp, "finish_reason": finish}
            )
        body_out = out.whole_response(
            obj="text_completion",
            rid=rid,
            created=int(time.time()),
            model=self.config.model,
            choices=choices,
            usage_=_usage([rec for rec, _ in recs]),
        )
        return orjson.dumps(body_out), recs[0][0]

    async def completion_stream(
        self, body: bytes, env: Envelope | None = None
    ) -> AsyncGenerator[bytes, None]:
        await self._screened(SCREEN_COMPLETION, body)
        req = parse_completion(body, vocab_size=self.tok.vocab_size)
        rid = out.response_id("cmpl")
        ot = await self._begin(env, None, rid)
        prompts = await self._completion_prompts(body, req, ot)
        template = self._template(req.sampling, req.logprobs or 0)
        recs = self._completion_recs(req, prompts)
        created = int(time.time())
        try:
            streams = [
                self._completion_choice_stream(
                    req,
                    rec,
                    template,
                    _choice_turn(ot, rid, k, len(recs)),
                    self._echo_text(req, prompts[i], req.prompts[i]),
                    _source_text(req.prompts[i]),
                    rid,
                    created,
                    k,
                )
                for k, (rec, i) in enumerate(recs)
            ]
            async with aclosing(
                self._choices_stream(
                    streams, [rec for rec, _ in recs], rid, created, "text_completion", req
                )
            ) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            for rec, _ in recs:
                self.controller.finish(rec)

    async def _completion_choice_stream(
        self,
        req: CompletionRequest,
        rec: GenerationRecord,
        template: GenerationRequest,
        ot: OpenTurn | None,
        echo: str,
        source: str,
        rid: str,
        created: int,
        index: int,
    ) -> AsyncGenerator[bytes, None]:
        top = req.logprobs or 0
        model = self.config.model
        texts: list[str] = []
        pending = echo
        offset = len(pending)
        usage_field = req.include_usage
        async with aclosing(self._text_steps(rec, template, req.sampling)) as steps:
            async for ts in steps:
                ids = ts.step.token_ids
                lp = None
                if req.logprobs is not None and ids:
                    lp = out.completion_logprobs(
                        self.tok,
                        ids,
                        ts.step.logprobs,
                        ts.step.top_logprobs,
                        with_top=top > 0,
                        offset=offset,
                    )
                    offset += sum(len(t) for t in lp["tokens"])
                text = pending + ts.text
                pending = ""
                if ot is not None:
                    texts.append(ts.text)
                    if ts.finish_reason is not None:
                        await self._commit(ot, source, "".join(texts), rec, ts.finish_reason)
                if text or lp is not None or ts.finish_reason is not None:
                    yield orjson.dumps(
                        out.completion_chunk(
                            rid=rid,
                            created=created,
                            model=model,
                            text=text,
                            finish_reason=ts.finish_reason,
                            logprobs=lp,
                            with_usage_field=usage_field,
                            index=index,
                        )
                    )


# Bodies above this are templated and tokenized off the event loop (about 100 us of work
# below it, the cost of the thread hop itself).
_INLINE_BODY_BYTES = 16 * 1024


def _heavy(body: bytes, ot: OpenTurn | None) -> bool:
    # A session's turn may continue a long parent (concat decodes all its tokens).
    return len(body) > _INLINE_BODY_BYTES or (ot is not None and ot.turn.parent is not None)


def _assistant(
    content: str | None, reasoning: str | None, calls: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The assistant message as recorded (and as the client will echo it back)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def _source_text(source: str | list[int]) -> str:
    """What a completions interaction records as its prompt text ("" for token ids)."""
    return source if isinstance(source, str) else ""


def _choice_turn(ot: OpenTurn | None, rid: str, index: int, total: int) -> OpenTurn | None:
    """The open turn of choice `index`: with one choice the request's own (its interaction id
    is the response id); with several, one sibling interaction each, `<response id>-<index>`."""
    if ot is None or total == 1:
        return ot
    return OpenTurn(
        ot.turn, f"{rid}-{index}", ot.started, ot.inherited, response_id=rid, choice_index=index
    )


def _usage(recs: list[GenerationRecord]) -> dict[str, int]:
    return out.usage(sum(len(r.prompt_ids) for r in recs), sum(len(r.token_ids) for r in recs))


async def _all(coros: Iterable[Awaitable[None]]) -> None:
    """Await every coroutine; on the first failure cancel the others, then raise it."""
    pending = list(coros)
    if len(pending) == 1:  # the usual case (n=1): no task, no extra turn of the loop
        await pending[0]
        return
    tasks = [asyncio.ensure_future(c) for c in pending]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(streams: list[AsyncGenerator[bytes, None]]) -> AsyncGenerator[bytes, None]:
    """The chunks of every choice's stream, in the order they are produced."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for chunk in only:
                yield chunk
        return
    # Bounded: a slow reader holds back every choice's stream (and through it the engine's
    # credit), as it does a single choice's.
    queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue(maxsize=2 * len(streams))

    async def pump(stream: AsyncGenerator[bytes, None]) -> None:
        try:
            async with aclosing(stream) as s:
                async for chunk in s:
                    await queue.put(chunk)
        except Exception as e:  # handed to the consumer, which raises it (cancellation is not)
            await queue.put(e)
            return
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
