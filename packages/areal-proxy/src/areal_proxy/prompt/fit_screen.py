"""Huge prompts that cannot fit the context, found in a child process (areal_runtime.offload).

A body of megabytes costs the proxy its JSON parse, its rendering and, when the context is
long, tokenizing millions of characters before it is known not to fit: work that holds the
GIL for tens of milliseconds to seconds, whichever thread does it, and so stalls the loop
that serves every other request, health and GetStats. A body over `SCREEN_MIN_BODY` is first
shown to the screen, a child process with its own tokenizer and template: if the prompt
cannot fit, the proxy refuses it without touching the body. Anything else (it fits, it is
malformed, the screen failed) goes on as if there were no screen, and the proxy's own
checks answer it, so the screen decides only one thing and never changes an answer.

It also refuses, whatever the context, a body with more structure than a request may have
(areal_runtime.bodycost: 413 `body_too_complex`), which the proxy would otherwise parse on its
loop: the gateway refuses those first, so this is for a body that reached the proxy another way.
The proxy sends a body here when it is over `SCREEN_MIN_BODY` (unless it continues its session
by less than that) or, whatever its size, when its estimated parse is over what the loop may
spend on one body.

Frames: one kind byte (`CHAT` or `COMPLETION`), then the request body. Answer: `{}`,
`{"tokens": n, "exact": bool, "param": name}` for a prompt the context cannot hold, or
`{"too_complex": message}`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import orjson

from areal_proxy.common.tokenizer import ModelTokenizer, PromptTooLong
from areal_proxy.prompt.chat_template import PromptBuilder, TemplateError
from areal_runtime.bodycost import too_complex
from areal_runtime.errors import ServiceError
from areal_runtime.openai import parse_chat, parse_completion

# Below this the proxy's own path is cheap enough (milliseconds): no hop to the child.
SCREEN_MIN_BODY = 256 * 1024
CHAT = b"c"
COMPLETION = b"p"
_GO_ON = b"{}"


def make(tokenizer_path: str, template_type: str, context_length: int) -> Callable[[bytes], bytes]:
    """The screen's function, for `Offload("areal_proxy.prompt.fit_screen:make", ...)`."""
    # One encoding thread: the screen is background work, and the tokenizers library would
    # otherwise spread a huge prompt over every core, the service's own included.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = ModelTokenizer.from_dir(tokenizer_path)
    prompts = PromptBuilder(tok, template_type=template_type) if tok.chat_template else None
    limit = context_length or tok.context_length

    def too_long(exc: PromptTooLong, param: str) -> bytes:
        return orjson.dumps({"tokens": exc.tokens, "exact": exc.exact, "param": param})

    def screen(frame: bytes) -> bytes:
        kind, body = frame[:1], frame[1:]
        refused = too_complex(body)
        if refused is not None:
            return orjson.dumps({"too_complex": refused.message})
        if not limit:
            return _GO_ON
        try:
            if kind == CHAT:
                if prompts is None:
                    return _GO_ON
                req = parse_chat(body)
                text = prompts.render_checked(req.messages, req.tools, req.template_kwargs, limit)
                tok.encode(text, limit=limit)  # counts in pieces, stops once past the limit
            elif kind == COMPLETION:
                creq = parse_completion(body, vocab_size=tok.vocab_size)
                for i, prompt in enumerate(creq.prompts):
                    param = "prompt" if len(creq.prompts) == 1 else f"prompt[{i}]"
                    try:
                        if isinstance(prompt, list):
                            if len(prompt) >= limit:
                                raise PromptTooLong(len(prompt))
                        elif (n := tok.min_tokens(prompt)) >= limit:
                            raise PromptTooLong(n, exact=False)
                        else:
                            tok.encode(prompt, add_special_tokens=True, limit=limit)
                    except PromptTooLong as exc:
                        return too_long(exc, param)
        except PromptTooLong as exc:
            return too_long(exc, "messages")
        except (ServiceError, TemplateError):
            return _GO_ON  # the proxy's own parse says what is wrong, in its words
        return _GO_ON

    return screen
