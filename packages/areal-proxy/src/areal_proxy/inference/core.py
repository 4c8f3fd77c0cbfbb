"""The prompt-and-record core under every OpenAI request: screen, parse, open the session's
turn, build the prompt, check the budget, start the generations; then the text of what they
generate, and the commit of each answer to the session. chat.py and completion.py shape
requests and responses over it; nothing here knows about gRPC."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import orjson

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.engine import refusals
from areal_proxy.engine.base import EngineError, GenerationRequest
from areal_proxy.generation.controller import GenerationController, GenerationRecord, Step
from areal_proxy.inference.choices import all_of, merged
from areal_proxy.inference.forced_tools import Scaffold, forced_constraint
from areal_proxy.output import openai_response as out
from areal_proxy.output.parsing import NO_PARSER
from areal_proxy.output.stop_strings import StopChecker, truncate_at_stop
from areal_proxy.output.structured_json import check, engine_schema
from areal_proxy.prompt.chat_template import (
    PromptBuilder,
    PromptTooLong,
    TemplateError,
    ToolsNotRendered,
)
from areal_proxy.prompt.fit_screen import CHAT as SCREEN_CHAT
from areal_proxy.prompt.fit_screen import COMPLETION as SCREEN_COMPLETION
from areal_proxy.prompt.fit_screen import SCREEN_MIN_BODY
from areal_proxy.prompt.incremental import Built, Previous, SessionPrompts
from areal_proxy.prompt.tool_prompt import can_prompt, default_tool_parser
from areal_proxy.recording.recorder import OpenTurn, Recorder
from areal_runtime import tracing
from areal_runtime.bodycost import parses_inline
from areal_runtime.errors import InvalidRequest, PayloadTooLarge, UpstreamError
from areal_runtime.offload import Offload, OffloadFailed
from areal_runtime.openai import (
    ChatRequest,
    CompletionRequest,
    Sampling,
    bad,
    parse_chat,
    parse_completion,
)

# max_tokens when neither the request nor the model says how long an answer may be.
FALLBACK_MAX_TOKENS = 4096
# Bodies above this are templated and tokenized off the event loop (about 100 us of work
# below it, the cost of the thread hop itself).
_INLINE_BODY_BYTES = 16 * 1024

log = logging.getLogger(__name__)

_T = TypeVar("_T")


# An engine limit this close to the model's context is the engine's margin, not its KV cache.
_ENGINE_MARGIN = 64


@dataclass(frozen=True, slots=True)
class InferenceConfig:
    model: str
    context_length: int = 0
    engine_max_tokens: int = 0
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    # A forced call's fixed text as token ids, not text (forced_tools.py; --forced-call-token-ids).
    forced_call_token_ids: bool = False


@dataclass(slots=True)
class TextStep:
    """A generation step with the text the client may see for it."""

    text: str
    step: Step
    finish_reason: str | None


@dataclass(slots=True)
class Prepared:
    """A request ready to generate: its generations started (one per choice), the session
    turn it records to (None: nothing recorded), and what they share."""

    rid: str
    ot: OpenTurn | None
    prompts: list[list[int]]
    template: GenerationRequest
    # One per choice, with the index of the prompt it answers (choice k = prompt i * n + j).
    recs: list[tuple[GenerationRecord, int]] = field(default_factory=list)
    # Each prompt's ids as JSON where the prompt builder made it (prompt/incremental.py).
    prompts_json: list[bytes | None] = field(default_factory=list)
    # The request's own JSON schema (response_format), that a finished output must meet.
    schema: dict[str, Any] | None = None
    # What an engine's refusal names (InferenceCore.refused): prompt i's field, and the field
    # that holds the output constraint.
    prompt_param: Callable[[int], str] = field(default=lambda _: "messages")
    constraint_param: str = "response_format"

    def turn_of(self, k: int) -> OpenTurn | None:
        """The open turn of choice `k`: with one choice the request's own (its interaction id
        is the response id); with several, one sibling interaction each, `<rid>-<k>`."""
        ot = self.ot
        if ot is None or len(self.recs) == 1:
            return ot
        return replace(ot, interaction_id=f"{self.rid}-{k}", response_id=self.rid, choice_index=k)


class InferenceCore:
    def __init__(
        self,
        config: InferenceConfig,
        tok: ModelTokenizer,
        prompts: PromptBuilder | None,
        controller: GenerationController,
        recorder: Recorder | None = None,
        executor: Executor | None = None,
        screen: Offload | None = None,
        on_prompt: Callable[[Built], None] | None = None,
    ) -> None:
        if prompts is not None:
            # Without --tool-call-parser, the one the chat template leaves no doubt about; a
            # template that ignores `tools` gets them in that parser's format (tool_prompt.py).
            template = prompts.template
            if not config.tool_call_parser:
                parser = default_tool_parser(template.source, template.renders_tools)
                config = replace(config, tool_call_parser=parser)
        if config.tool_call_parser == NO_PARSER:
            config = replace(config, tool_call_parser="")
        if prompts is not None:
            prompts.template.tool_parser = config.tool_call_parser
        self.config = config
        # The template ignores `tools` and the proxy writes them in (tool_prompt.py); GetStats
        # says so, and `areal inf status` shows how tools reach this model.
        self.default_tool_prompt = (
            prompts is not None
            and not prompts.template.renders_tools
            and can_prompt(config.tool_call_parser)
        )
        log.info(
            "tool-call parser: %s%s",
            config.tool_call_parser or "none",
            " (the chat template does not render tools: the proxy's default tool prompt)"
            if self.default_tool_prompt
            else "",
        )
        self.tok = tok
        # Forced tool calls' fixed text as this tokenizer's ids (forced_tools.py), if asked.
        self.scaffold = Scaffold(tok.encode) if config.forced_call_token_ids else None
        self.prompts = prompts
        self.controller = controller
        # The limit every prompt is checked against: the model's context (or
        # --context-length), lowered to what the engine takes once that is learned
        # (learn_engine_limit).
        self.model_context = config.context_length or tok.context_length
        self.engine_context = 0
        self._engine_context_known = False
        self.context_length = self.model_context
        # A session turn's prompt continues its previous turn's (prompt/incremental.py).
        self.session_prompts = SessionPrompts(prompts, tok) if prompts is not None else None
        if recorder is not None and recorder.prompts is None:
            recorder.prompts = self.session_prompts
        self.recorder = recorder
        # Where templating and tokenizing run (None: inline, for tests): never on the event
        # loop, which must keep serving the other requests, health and GetStats while a
        # prompt of megabytes takes seconds (the tokenizers library releases the GIL while
        # it encodes, so the loop runs meanwhile).
        self.executor = executor
        # Huge bodies are first shown to a child process that refuses a prompt the context
        # cannot hold, without this process touching the body (screen.py).
        self.screen = screen
        self.on_prompt = on_prompt

    # ---- the prelude: screen, parse, turn, prompt, budget ------------------------------

    async def _screened(self, kind: bytes, body: bytes, env: Envelope | None) -> None:
        """Refuse a huge body whose prompt cannot fit, or any body with more structure than
        a request may have (areal_runtime.bodycost), on the screen's word; anything else
        (and a screen that failed) goes on to this proxy's own checks. A session's body that
        outgrows its previous one by less than the screen's threshold is no detour: what is
        new in it costs what a small body costs (the rest continues the previous turn); but
        growth is no pass on cost: a body whose parse is estimated too long for this loop is
        screened however it was reached."""
        if self.screen is None:
            return
        if parses_inline(body):
            if len(body) <= SCREEN_MIN_BODY or not self.context_length:
                return
            if env is not None and env.session_id and self.recorder is not None:
                known = self.recorder.book.turns.body_bytes(env.session_id)
                if known and len(body) - known <= SCREEN_MIN_BODY:
                    return
        try:
            answer = orjson.loads(await self.screen.call(kind, body))
        except OffloadFailed as exc:
            log.warning("prompt screen: %s; checking the prompt here", exc)
            return
        if "too_complex" in answer:
            raise PayloadTooLarge(answer["too_complex"], code="body_too_complex")
        if "tokens" in answer:
            raise self._too_long(answer["tokens"], answer["param"], at_least=not answer["exact"])

    async def _off_loop(self, heavy: bool, fn: Callable[..., _T], /, *args: Any) -> _T:
        """`fn(*args)` on the executor when `heavy`; a small prompt costs less than the hop."""
        if self.executor is None or not heavy:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    # ---- what the engine takes ---------------------------------------------------------

    async def learn_engine_limit(self, reconnected: bool) -> None:
        """Ask the engine how long a request it takes (engine clients' `context_limit`): on
        every (re)connection, and after each failed try until it answers. An engine that
        takes less than the model's context (SGLang with --max-total-tokens 4096 under a
        model of 8192) would refuse such a prompt, or silently cut the output short; the
        smaller limit wins. Never raises: a proxy without the answer keeps the model's."""
        if self._engine_context_known and not reconnected:
            return
        ask = getattr(self.controller.engine, "context_limit", None)
        if ask is None:
            self._engine_context_known = True
            return
        try:
            limit = int(await ask())
        except Exception as e:  # any failure: asked again on the next check
            log.warning("could not read the engine's context limit (asked again): %s", e)
            return
        self._engine_context_known = True
        self.set_engine_context(limit)

    def set_engine_context(self, limit: int) -> None:
        self.engine_context = max(0, limit)
        limits = [n for n in (self.model_context, self.engine_context) if n > 0]
        context = min(limits) if limits else 0
        if context != self.context_length:
            log.info(
                "prompts are checked against %d tokens (model context %d, engine %d)",
                context,
                self.model_context,
                self.engine_context,
            )
        self.context_length = context

    def _engine_binds(self) -> bool:
        return 0 < self.engine_context and (
            self.model_context <= 0 or self.engine_context < self.model_context
        )

    def _too_long(self, tokens: int, param: str, *, at_least: bool = False) -> InvalidRequest:
        size = f"the prompt is {'at least ' if at_least else ''}{tokens} tokens"
        if self._engine_binds() and self.model_context - self.engine_context <= _ENGINE_MARGIN:
            # SGLang takes a few tokens less than the model's context (its own margin): the
            # model's context is the limit, and no engine flag lifts it.
            limit = (
                f"this model's context length is {self.model_context} (its engine takes "
                f"prompts of fewer than {self.engine_context} tokens); shorten '{param}' or "
                "serve a model with a longer context"
            )
        elif self._engine_binds():
            limit = (
                f"the engine serving this model takes prompts of fewer than "
                f"{self.engine_context} tokens (its KV cache or context is smaller than the "
                f"model's {self.model_context}); shorten '{param}' or start the engine with a "
                "larger --max-total-tokens"
            )
        else:
            limit = f"this model's context length is {self.context_length}; shorten '{param}'"
        return bad(f"{size}; {limit}", param, "context_length_exceeded")

    def refused(self, e: EngineError, prompt_param: str, constraint_param: str) -> InvalidRequest:
        """The engine's refusal of the request (EngineError.refused) as the client's 400, naming
        what to change; the engine's own words follow, cleaned (engine/refusals.py)."""
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
            constraint=_engine_constraint(s),
        )

    def _start(self, p: Prepared, sampling: Sampling, param: Callable[[int], str]) -> None:
        """One generation per choice: prompt i's j-th sample is choice i * n + j (as OpenAI).
        Every budget is checked before any generation starts (none is left in flight)."""
        budgets = [
            self._budget(len(prompt), sampling.max_tokens, param(i))
            for i, prompt in enumerate(p.prompts)
        ]
        # Choices generated together are never migrated one by one (generation.py).
        together = len(p.prompts) * sampling.n
        for i, (prompt, budget) in enumerate(zip(p.prompts, budgets, strict=True)):
            encoded = p.prompts_json[i] if p.prompts_json else None
            p.recs.extend(
                (self.controller.start(prompt, budget, encoded, together=together), i)
                for _ in range(sampling.n)
            )

    def finish(self, p: Prepared) -> None:
        for rec, _ in p.recs:
            self.controller.finish(rec)

    async def stream_choices(
        self,
        p: Prepared,
        streams: list[AsyncGenerator[bytes, None]],
        created: int,
        obj: str,
        include_usage: bool,
    ) -> AsyncGenerator[bytes, None]:
        """Every choice's chunks as they come, then the usage chunk when asked for; the
        generations are finished however the stream ends."""
        try:
            async with aclosing(merged(streams)) as chunks:
                async for chunk in chunks:
                    yield chunk
            if include_usage:
                yield orjson.dumps(
                    out.usage_chunk(
                        rid=p.rid,
                        created=created,
                        model=self.config.model,
                        obj=obj,
                        usage_=usage(p.recs),
                    )
                )
        finally:
            self.finish(p)

    async def _begin(
        self, env: Envelope | None, messages: list[dict[str, Any]] | None, rid: str, body: bytes
    ) -> OpenTurn | None:
        if self.recorder is None:
            return None
        return await self.recorder.begin(env, messages, rid, len(body))

    # ---- chat prompts ------------------------------------------------------------------

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
        except ToolsNotRendered as e:
            raise bad(str(e), "tools", "unsupported_parameter") from None

    def chat_prompt(
        self, req: ChatRequest, ot: OpenTurn | None = None, rendered: str | None = None
    ) -> list[int]:
        """The prompt ids of a chat request; a session's turn continues its previous turn's
        prompt where that is exact (prompt/incremental.py)."""
        prompts = self._prompts()
        try:
            if ot is None or self.session_prompts is None:
                return prompts.prompt_ids(
                    req.messages,
                    req.tools,
                    req.template_kwargs,
                    limit=self.context_length,
                    rendered=rendered,
                )
            built = self.session_prompts.build(
                req.messages,
                req.tools,
                req.template_kwargs,
                ot.turn.previous or Previous(),
                limit=self.context_length,
                rendered=rendered,
            )
        except PromptTooLong as e:
            raise self._too_long(e.tokens, "messages", at_least=not e.exact) from None
        except TemplateError as e:
            raise bad(str(e), "messages", "chat_template_error") from None
        except ToolsNotRendered as e:
            raise bad(str(e), "tools", "unsupported_parameter") from None
        ot.prompt = built
        if self.on_prompt is not None:
            self.on_prompt(built)
        return built.ids

    async def prepare_chat(
        self, body: bytes, env: Envelope | None, rid: str
    ) -> tuple[ChatRequest, Prepared]:
        """Screen, parse, open the turn, render and tokenize, start the generations."""
        with tracing.span("proxy.prepare", endpoint="chat", body_bytes=len(body)) as sp:
            req, p = await self._prepare_chat(body, env, rid)
            _note_prepared(sp, p)
            return req, p

    async def _prepare_chat(
        self, body: bytes, env: Envelope | None, rid: str
    ) -> tuple[ChatRequest, Prepared]:
        await self._screened(SCREEN_CHAT, body, env)
        req = parse_chat(body)
        # A big body is rendered and checked against the context first (off the loop): a
        # prompt that cannot fit is refused before its turn is looked up (the lineage hashes
        # every message) and before it is tokenized, the costs that grow with its size.
        rendered = None
        if len(body) > _INLINE_BODY_BYTES:
            rendered = await self._off_loop(True, self.chat_text, req)
        ot = await self._begin(env, req.messages, rid, body)
        if ot is not None:
            ot.body_bytes = len(body)
            ot.tools_declared = len(req.tools or ())
        prompt = await self._off_loop(_heavy(body, ot), self.chat_prompt, req, ot, rendered)
        template = self._template(req.sampling, req.top_logprobs)
        forced = forced_constraint(
            self.config.tool_call_parser,
            self.config.reasoning_parser,
            req.tools,
            req.tool_choice,
            req.parallel_tool_calls,
            self.scaffold,
        )
        if forced is not None:
            if template.constraint is not None:
                raise bad(
                    "a forced 'tool_choice' and a constrained 'response_format' cannot both "
                    "hold the output",
                    "tool_choice",
                )
            template.constraint = (forced.kind, forced.value)
        p = Prepared(rid, ot, [prompt], template, schema=_schema(req.sampling))
        p.constraint_param = "tools" if forced is not None else _constraint_param(template)
        if ot is not None and ot.prompt is not None:
            p.prompts_json = [ot.prompt.ids_json]
        self._start(p, req.sampling, lambda _: "messages")
        return req, p

    # ---- completion prompts ------------------------------------------------------------

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

    async def prepare_completion(
        self, body: bytes, env: Envelope | None, rid: str
    ) -> tuple[CompletionRequest, Prepared]:
        with tracing.span("proxy.prepare", endpoint="completions", body_bytes=len(body)) as sp:
            req, p = await self._prepare_completion(body, env, rid)
            _note_prepared(sp, p)
            return req, p

    async def _prepare_completion(
        self, body: bytes, env: Envelope | None, rid: str
    ) -> tuple[CompletionRequest, Prepared]:
        await self._screened(SCREEN_COMPLETION, body, env)
        req = parse_completion(body, vocab_size=self.tok.vocab_size)
        ot = await self._begin(env, None, rid, body)
        heavy = _heavy(body, ot)
        param = _prompt_param(len(req.prompts))
        prompts = []
        for i, source in enumerate(req.prompts):
            one = replace(
                req,
                prompt_text=source if isinstance(source, str) else None,
                prompt_ids=source if not isinstance(source, str) else None,
            )
            prompts.append(await self._off_loop(heavy, self.completion_prompt, one, param(i)))
        p = Prepared(
            rid,
            ot,
            prompts,
            self._template(req.sampling, req.logprobs or 0),
            schema=_schema(req.sampling),
        )
        p.prompt_param = param
        p.constraint_param = _constraint_param(p.template)
        self._start(p, req.sampling, param)
        return req, p

    # ---- generated text ----------------------------------------------------------------

    def _visible_ids(self, ids: list[int], finish: str | None, stop_ids: list[int]) -> list[int]:
        """Output ids whose text the client sees: without the stop token that ended them."""
        if finish == "stop" and ids and ids[-1] in stop_ids:
            return ids[:-1]
        return ids

    async def generate_all(self, p: Prepared) -> None:
        """Every choice's whole generation; an engine's refusal is the client's 400."""

        async def one(rec: GenerationRecord, i: int) -> None:
            try:
                await self.controller.generate(rec, p.template)
            except EngineError as e:
                if not e.refused:
                    raise
                raise self.refused(e, p.prompt_param(i), p.constraint_param) from None

        await all_of(one(rec, i) for rec, i in p.recs)

    async def text_steps(
        self, p: Prepared, rec: GenerationRecord, prompt_index: int, s: Sampling
    ) -> AsyncGenerator[TextStep, None]:
        """A streamed generation's steps with their text, cut at a stop string; an engine's
        refusal is the client's 400."""
        try:
            async with aclosing(self._text_steps(rec, p.template, s)) as steps:
                async for ts in steps:
                    yield ts
        except EngineError as e:
            if not e.refused:
                raise
            raise self.refused(e, p.prompt_param(prompt_index), p.constraint_param) from None

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

    def final_text(
        self, rec: GenerationRecord, template: GenerationRequest, s: Sampling
    ) -> tuple[str, str]:
        """A whole generation's text and finish reason, cut at a stop string."""
        finish = rec.finish_reason or "abort"
        ids = self._visible_ids(rec.token_ids, finish, template.stop_token_ids)
        text = self.tok.decode(ids, skip_special_tokens=s.skip_special_tokens)
        if s.stop:
            text, hit = truncate_at_stop(text, s.stop)
            if hit:
                finish = "stop"
        return text, finish

    def check_json(self, p: Prepared, text: str, finish: str) -> None:
        """Refuse to answer with a finished output that breaks the request's JSON schema: the
        engine's grammar let it through (structured_json.py), and a client told "stop" would
        take it for a valid document. A 502, as any upstream answer that breaks its contract;
        nothing is recorded for it. A cut output ("length") is returned as it is, as OpenAI
        returns one."""
        if p.schema is None or finish != "stop":
            return
        if (why := check(p.schema, text)) is not None:
            log.warning("constrained output rejected: %s", why)
            raise UpstreamError(
                f"the engine's constrained decoding made an output that is not valid for "
                f"'response_format': {why}; send the request again",
                code="invalid_structured_output",
            )

    # ---- recording ---------------------------------------------------------------------

    async def commit(
        self,
        ot: OpenTurn | None,
        messages: list[dict[str, Any]] | str,
        response: dict[str, Any] | str,
        rec: GenerationRecord,
        finish: str,
        tool_calls: tuple[int, int] = (0, 0),
    ) -> None:
        """Record one answered choice of a session's turn (nothing without a session);
        `tool_calls`: (calls its output made, calls the parser read)."""
        if ot is not None and self.recorder is not None:
            session = ot.turn.session
            with tracing.span(
                "proxy.commit",
                session_id=session.session_id,
                group_id=session.group_id,
                interaction_id=ot.interaction_id,
                output_tokens=len(rec.token_ids),
            ):
                await self.recorder.commit(
                    ot,
                    messages=messages,
                    response=response,
                    rec=rec,
                    finish_reason=finish,
                    tool_calls=tool_calls,
                )


def _note_prepared(sp: tracing.Span, p: Prepared) -> None:
    """The prepared request's identity and size on its span (off: nothing computed)."""
    if not tracing.ON:
        return
    ot = p.ot
    sp.set(
        rid=p.rid,
        session_id=ot.turn.session.session_id if ot is not None else None,
        group_id=ot.turn.session.group_id if ot is not None else None,
        prompt_tokens=sum(len(x) for x in p.prompts),
        choices=len(p.recs),
    )


def _schema(s: Sampling) -> dict[str, Any] | None:
    c = s.constraint
    if c is None or c.kind != "json_schema":
        return None
    schema = orjson.loads(c.value)
    return schema if isinstance(schema, dict) else None


def _engine_constraint(s: Sampling) -> tuple[str, str] | None:
    """The request's constraint as the engine's grammar gets it (structured_json.py)."""
    c = s.constraint
    if c is None:
        return None
    if c.kind == "json_schema":
        tight = engine_schema(orjson.loads(c.value), "response_format")
        return c.kind, orjson.dumps(tight).decode()
    return c.kind, c.value


def _heavy(body: bytes, ot: OpenTurn | None) -> bool:
    # A session's turn may continue a long parent (concat decodes all its tokens).
    return len(body) > _INLINE_BODY_BYTES or (ot is not None and ot.turn.parent is not None)


def _constraint_param(template: GenerationRequest) -> str:
    """The request field a constraint came from: SGLang's `regex` / `ebnf` (a regex may also
    sit in `response_format.regex`), else `response_format`'s JSON schema."""
    kind = template.constraint[0] if template.constraint else ""
    return kind if kind in ("regex", "ebnf") else "response_format"


def _prompt_param(n_prompts: int) -> Callable[[int], str]:
    return (lambda _: "prompt") if n_prompts == 1 else (lambda i: f"prompt[{i}]")


def usage(recs: list[tuple[GenerationRecord, int]]) -> dict[str, int]:
    return out.usage(
        sum(len(r.prompt_ids) for r, _ in recs), sum(len(r.token_ids) for r, _ in recs)
    )
