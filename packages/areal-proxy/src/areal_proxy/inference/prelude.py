"""The prelude of every request, chat or completion: screen the body, parse it, open the
session's turn, build the prompt, check the budget, set the sampling template (a forced tool
call's constraint included), and start one generation per choice."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import orjson

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.engine.base import GenerationRequest
from areal_proxy.generation.controller import GenerationController
from areal_proxy.inference.forced_tools import Scaffold, forced_constraint
from areal_proxy.inference.limits import ContextLimits
from areal_proxy.inference.prepared import InferenceConfig, Prepared
from areal_proxy.output.structured_json import engine_schema
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
from areal_proxy.recording.recorder import OpenTurn, Recorder
from areal_runtime import tracing
from areal_runtime.bodycost import parses_inline
from areal_runtime.errors import PayloadTooLarge
from areal_runtime.offload import Offload, OffloadFailed
from areal_runtime.openai import (
    ChatRequest,
    CompletionRequest,
    Sampling,
    bad,
    parse_chat,
    parse_completion,
)

# Bodies above this are templated and tokenized off the event loop (about 100 us of work
# below it, the cost of the thread hop itself).
INLINE_BODY_BYTES = 16 * 1024

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Prelude:
    """Everything between a request's bytes and its started generations."""

    def __init__(
        self,
        config: InferenceConfig,
        tok: ModelTokenizer,
        prompts: PromptBuilder | None,
        session_prompts: SessionPrompts | None,
        controller: GenerationController,
        limits: ContextLimits,
        recorder: Recorder | None = None,
        executor: Executor | None = None,
        screen: Offload | None = None,
        on_prompt: Callable[[Built], None] | None = None,
    ) -> None:
        self.config = config
        self.tok = tok
        self.prompts = prompts
        # A session turn's prompt continues its previous turn's (prompt/incremental.py).
        self.session_prompts = session_prompts
        self.controller = controller
        self.limits = limits
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
        # Forced tool calls' fixed text as this tokenizer's ids (forced_tools.py), if asked.
        self.scaffold = Scaffold(tok.encode) if config.forced_call_token_ids else None

    # ---- chat ----------------------------------------------------------------------

    async def chat(
        self, body: bytes, env: Envelope | None, rid: str
    ) -> tuple[ChatRequest, Prepared]:
        """Screen, parse, open the turn, render and tokenize, start the generations."""
        with tracing.span("proxy.prepare", endpoint="chat", body_bytes=len(body)) as sp:
            req, p = await self._chat(body, env, rid)
            _note_prepared(sp, p)
            return req, p

    async def _chat(
        self, body: bytes, env: Envelope | None, rid: str
    ) -> tuple[ChatRequest, Prepared]:
        await self._screened(SCREEN_CHAT, body, env)
        req = parse_chat(body)
        # A big body is rendered and checked against the context first (off the loop): a
        # prompt that cannot fit is refused before its turn is looked up (the lineage hashes
        # every message) and before it is tokenized, the costs that grow with its size.
        rendered = None
        if len(body) > INLINE_BODY_BYTES:
            rendered = await self.off_loop(True, self.chat_text, req)
        ot = await self._begin(env, req.messages, rid, body)
        if ot is not None:
            ot.body_bytes = len(body)
            ot.tools_declared = len(req.tools or ())
        prompt = await self.off_loop(_heavy(body, ot), self.chat_prompt, req, ot, rendered)
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
        p = Prepared(
            rid,
            ot,
            [prompt],
            template,
            schema=_schema(req.sampling),
            constraint_param="tools" if forced is not None else _constraint_param(template),
        )
        if ot is not None and ot.prompt is not None:
            p.prompts_json = [ot.prompt.ids_json]
        self._start(p, req.sampling)
        return req, p

    def _builder(self) -> PromptBuilder:
        if self.prompts is None:
            raise bad("this model has no chat template; use /v1/completions", "messages")
        return self.prompts

    def chat_text(self, req: ChatRequest) -> str:
        """The rendered conversation, refused if its length alone rules out the context."""
        try:
            return self._builder().render_checked(
                req.messages, req.tools, req.template_kwargs, self.limits.context_length
            )
        except PromptTooLong as e:
            raise self.limits.too_long(e.tokens, "messages", at_least=not e.exact) from None
        except TemplateError as e:
            raise bad(str(e), "messages", "chat_template_error") from None
        except ToolsNotRendered as e:
            raise bad(str(e), "tools", "unsupported_parameter") from None

    def chat_prompt(
        self, req: ChatRequest, ot: OpenTurn | None = None, rendered: str | None = None
    ) -> list[int]:
        """The prompt ids of a chat request; a session's turn continues its previous turn's
        prompt where that is exact (prompt/incremental.py)."""
        builder = self._builder()
        limit = self.limits.context_length
        try:
            if ot is None or self.session_prompts is None:
                return builder.prompt_ids(
                    req.messages, req.tools, req.template_kwargs, limit=limit, rendered=rendered
                )
            built = self.session_prompts.build(
                req.messages,
                req.tools,
                req.template_kwargs,
                ot.turn.previous or Previous(),
                limit=limit,
                rendered=rendered,
            )
        except PromptTooLong as e:
            raise self.limits.too_long(e.tokens, "messages", at_least=not e.exact) from None
        except TemplateError as e:
            raise bad(str(e), "messages", "chat_template_error") from None
        except ToolsNotRendered as e:
            raise bad(str(e), "tools", "unsupported_parameter") from None
        ot.prompt = built
        if self.on_prompt is not None:
            self.on_prompt(built)
        return built.ids

    # ---- completion ----------------------------------------------------------------

    async def completion(
        self, body: bytes, env: Envelope | None, rid: str
    ) -> tuple[CompletionRequest, Prepared]:
        with tracing.span("proxy.prepare", endpoint="completions", body_bytes=len(body)) as sp:
            req, p = await self._completion(body, env, rid)
            _note_prepared(sp, p)
            return req, p

    async def _completion(
        self, body: bytes, env: Envelope | None, rid: str
    ) -> tuple[CompletionRequest, Prepared]:
        await self._screened(SCREEN_COMPLETION, body, env)
        req = parse_completion(body, vocab_size=self.tok.vocab_size)
        ot = await self._begin(env, None, rid, body)
        heavy = _heavy(body, ot)
        param = _prompt_param(len(req.prompts))
        prompts = []
        for i, source in enumerate(req.prompts):
            prompts.append(await self.off_loop(heavy, self.completion_prompt, source, param(i)))
        template = self._template(req.sampling, req.logprobs or 0)
        p = Prepared(
            rid,
            ot,
            prompts,
            template,
            schema=_schema(req.sampling),
            prompt_param=param,
            constraint_param=_constraint_param(template),
        )
        self._start(p, req.sampling)
        return req, p

    def completion_prompt(self, source: str | list[int], param: str = "prompt") -> list[int]:
        """One prompt's ids: token ids as they came, a text tokenized (checked against the
        context first by its length alone)."""
        if not isinstance(source, str):
            return source
        text = source
        ctx = self.limits.context_length
        if ctx and (n := self.tok.min_tokens(text)) >= ctx:
            raise self.limits.too_long(n, param, at_least=True)
        try:
            ids = self.tok.encode(text, add_special_tokens=True, limit=ctx)
        except PromptTooLong as e:
            raise self.limits.too_long(e.tokens, param) from None
        if not ids:
            raise bad(f"'{param}' encodes to no tokens", param)
        return ids

    # ---- shared --------------------------------------------------------------------

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
            if len(body) <= SCREEN_MIN_BODY or not self.limits.context_length:
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
            raise self.limits.too_long(
                answer["tokens"], answer["param"], at_least=not answer["exact"]
            )

    async def off_loop(self, heavy: bool, fn: Callable[..., _T], /, *args: Any) -> _T:
        """`fn(*args)` on the executor when `heavy`; a small prompt costs less than the hop."""
        if self.executor is None or not heavy:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    async def _begin(
        self, env: Envelope | None, messages: list[dict[str, Any]] | None, rid: str, body: bytes
    ) -> OpenTurn | None:
        if self.recorder is None:
            return None
        return await self.recorder.begin(env, messages, rid, len(body))

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

    def _start(self, p: Prepared, sampling: Sampling) -> None:
        """One generation per choice: prompt i's j-th sample is choice i * n + j (as OpenAI).
        Every budget is checked before any generation starts (none is left in flight)."""
        budgets = [
            self.limits.budget(len(prompt), sampling.max_tokens, p.prompt_param(i))
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
    return len(body) > INLINE_BODY_BYTES or (ot is not None and ot.turn.parent is not None)


def _constraint_param(template: GenerationRequest) -> str:
    """The request field a constraint came from: SGLang's `regex` / `ebnf` (a regex may also
    sit in `response_format.regex`), else `response_format`'s JSON schema."""
    kind = template.constraint[0] if template.constraint else ""
    return kind if kind in ("regex", "ebnf") else "response_format"


def _prompt_param(n_prompts: int) -> Callable[[int], str]:
    return (lambda _: "prompt") if n_prompts == 1 else (lambda i: f"prompt[{i}]")
