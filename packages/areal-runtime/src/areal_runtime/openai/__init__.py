"""The OpenAI request protocol areal honours, parsed once per hop into typed requests.

fields.py: the fields honoured, the errors, the body decode; sampling.py: sampling settings
and output constraints; requests.py: chat and completion requests; messages.py: the
canonical message form both hops hash.
"""

from areal_runtime.openai.fields import RequestHead, bad, load_body, read_head, unsupported
from areal_runtime.openai.requests import (
    ChatRequest,
    CompletionRequest,
    messages_of,
    parse_chat,
    parse_completion,
    prompt_of,
)
from areal_runtime.openai.sampling import Constraint, Sampling, response_format_constraint

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "Constraint",
    "RequestHead",
    "Sampling",
    "bad",
    "load_body",
    "messages_of",
    "parse_chat",
    "parse_completion",
    "prompt_of",
    "read_head",
    "response_format_constraint",
    "unsupported",
]
