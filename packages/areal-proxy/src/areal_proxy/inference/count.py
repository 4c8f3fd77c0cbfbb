"""`CountTokens`: the size of a chat request's prompt, nothing generated or recorded.

The chat body is parsed as `/v1/chat/completions` parses it and rendered with this model's
chat template (the request's `tools` and `chat_template_kwargs` included, the generation
prompt added) and tokenized with its tokenizer: the prompt a generation outside a session
sends the engine. A session's turn may continue its previous turn's exact ids instead
(prompt/incremental.py), which can differ from a fresh rendering by a few tokens at the
boundary; a count is an estimate of the next prompt, as Anthropic's own is.

No context limit applies: the count of a prompt that cannot fit is what a client needs to
know that it must shorten it (the body itself is bounded by the gateway's size limit).
"""

from __future__ import annotations

from areal_proxy.inference.core import InferenceCore
from areal_proxy.inference.prelude import INLINE_BODY_BYTES
from areal_proxy.prompt.chat_template import TemplateError, ToolsNotRendered
from areal_runtime.bodycost import parses_inline, too_complex
from areal_runtime.openai import ChatRequest, bad, parse_chat


def _count(core: InferenceCore, req: ChatRequest) -> int:
    if core.prompts is None:
        raise bad("this model has no chat template; it takes /v1/completions only", "messages")
    try:
        ids = core.prompts.prompt_ids(req.messages, req.tools, req.template_kwargs)
    except TemplateError as e:
        raise bad(str(e), "messages", "chat_template_error") from None
    except ToolsNotRendered as e:
        raise bad(str(e), "tools", "unsupported_parameter") from None
    return len(ids)


async def count_tokens(core: InferenceCore, body: bytes) -> int:
    # No prompt screen here (no context limit applies), but a body with more structure than a
    # request may have is refused before this loop parses it (areal_runtime.bodycost).
    if not parses_inline(body):
        refused = too_complex(body)
        if refused is not None:
            raise refused
    req = parse_chat(body)
    return await core.prelude.off_loop(len(body) > INLINE_BODY_BYTES, _count, core, req)
