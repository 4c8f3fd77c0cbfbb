"""The `concat` chat template: a turn's prompt continues the previous turn's exact tokens.

Re-tokenizing a whole conversation each turn can produce different ids for
text the model generated (token-id drift), which corrupts RL training. Here
the new prompt is the parent's prompt + output ids, followed by the tokens of
only the text the template adds after them.
"""

from __future__ import annotations

from collections.abc import Callable


def continue_tokens(
    parent_tokens: list[int],
    rendered: str,
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
) -> list[int] | None:
    """`parent_tokens` + the tokens of what `rendered` adds after them, or None.

    `rendered` is the chat template applied to the whole new conversation;
    `decode` must keep special tokens. None when the rendered conversation
    does not start with the parent's text (the client changed history, or
    echoed the answer differently), in which case the caller re-tokenizes.
    """
    prefix = decode(parent_tokens)
    if not rendered.startswith(prefix):
        return None
    return parent_tokens + encode(rendered[len(prefix) :])
