"""How long a prompt and its answer may be: the model's context, lowered to what the engine
takes once that is learned, the refusal of a prompt that cannot fit, and each answer's
budget."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from areal_runtime.errors import InvalidRequest
from areal_runtime.openai import bad

# max_tokens when neither the request nor the model says how long an answer may be.
FALLBACK_MAX_TOKENS = 4096
# An engine limit this close to the model's context is the engine's margin, not its KV cache.
_ENGINE_MARGIN = 64

log = logging.getLogger(__name__)


class ContextLimits:
    """The limit every prompt is checked against: the model's context (or --context-length),
    lowered to what the engine takes once that is learned (`learn`)."""

    def __init__(
        self,
        model_context: int,
        engine_max_tokens: int,
        ask_engine: Callable[[], Awaitable[int]] | None,
    ) -> None:
        self.model_context = model_context
        # --engine-max-tokens: a cap on every answer's budget (0: none).
        self.engine_max_tokens = engine_max_tokens
        # The engine client's `context_limit` (None: an engine that cannot say).
        self._ask = ask_engine
        self.engine_context = 0
        self._engine_known = ask_engine is None
        self.context_length = model_context

    async def learn(self, reconnected: bool) -> None:
        """Ask the engine how long a request it takes: on every (re)connection, and after
        each failed try until it answers. An engine that takes less than the model's context
        (SGLang with --max-total-tokens 4096 under a model of 8192) would refuse such a
        prompt, or silently cut the output short; the smaller limit wins. Never raises: a
        proxy without the answer keeps the model's."""
        if self._ask is None or (self._engine_known and not reconnected):
            return
        try:
            limit = int(await self._ask())
        except Exception as e:  # any failure: asked again on the next check
            log.warning("could not read the engine's context limit (asked again): %s", e)
            return
        self._engine_known = True
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

    def too_long(self, tokens: int, param: str, *, at_least: bool = False) -> InvalidRequest:
        """The 400 for a prompt of `tokens` that cannot fit, naming the limit that binds."""
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

    def budget(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        """An answer's max_new_tokens: what was asked for (else what the context leaves),
        within --engine-max-tokens and what the context leaves."""
        ctx = self.context_length
        if ctx and prompt_len >= ctx:
            raise self.too_long(prompt_len, prompt_param)
        budget = (
            requested
            if requested is not None
            else (ctx - prompt_len if ctx else FALLBACK_MAX_TOKENS)
        )
        if self.engine_max_tokens > 0:
            budget = min(budget, self.engine_max_tokens)
        if ctx:
            budget = min(budget, ctx - prompt_len)
        return budget
