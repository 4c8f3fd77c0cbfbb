"""The OpenAI and Anthropic bodies as the OpenAPI document shows them.

The generation endpoints parse their bodies themselves, once, on the fast path
(fastpath.py; chat.py, completions.py, responses/request.py, anthropic/request.py hold the
rules and their messages); these models only describe them: the main fields and their
types. Bodies the endpoint passes on to the engine (chat, completions) take more fields
than listed (`additionalProperties`); a Responses or Messages body is refused (400
`unsupported_parameter`) for a field it does not list (the tests hold these lists to the
parsers' own). The answers are OpenAI's and
Anthropic's own shapes, described by their top-level fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The example bodies' model (Swagger UI's "Try it out" sends the example as it is): what a
# gateway serves is not known when this is written, so GET /openapi.json puts a model of the
# catalog in its place (apidoc.py); with none registered yet, this name says where to look.
MODEL_EXAMPLE = "MODEL_FROM_GET_/v1/models"
_HI = [{"role": "user", "content": "Say hello in five words."}]


def _examples(*bodies: dict[str, Any]) -> ConfigDict:
    return ConfigDict(json_schema_extra={"examples": list(bodies)})


def _model(description: str = "a served model (GET /v1/models)") -> Any:
    return Field(description=description, examples=[MODEL_EXAMPLE])


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- chat completions, completions ---------------------------------------------------------


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_Open):
    """`POST /v1/chat/completions`: OpenAI's chat body; other fields go to the engine."""

    model_config = _examples({"model": MODEL_EXAMPLE, "messages": _HI, "max_tokens": 32})
    model: str = _model()
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class ChatCompletion(_Open):
    """A whole chat completion (a stream: `text/event-stream` of `chat.completion.chunk`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class CompletionRequest(_Open):
    """`POST /v1/completions`: OpenAI's legacy completion body; other fields go to the
    engine."""

    model_config = _examples({"model": MODEL_EXAMPLE, "prompt": "Once upon a", "max_tokens": 16})
    model: str = _model()
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool | None = None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


# --- responses -------------------------------------------------------------------------------


class CreateResponseRequest(_Closed):
    """`POST /v1/responses`: translated onto the chat path (docs/services.md, "Responses
    API"); a field not listed here is a 400 `unsupported_parameter`."""

    model_config = _examples(
        {"model": MODEL_EXAMPLE, "input": "Say hello in five words.", "max_output_tokens": 32}
    )
    model: str = _model()
    input: str | list[dict[str, Any]] | None = Field(
        default=None,
        description="a string (one user message) or input items: message, function_call, "
        "function_call_output, custom_tool_call, custom_tool_call_output, reasoning; "
        "optional with previous_response_id",
    )
    instructions: str | None = None
    previous_response_id: str | None = Field(
        default=None, description="continue a stored response (the same key's)"
    )
    store: bool = Field(default=True, description="false: not kept (no GET, no continuing)")
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    tools: list[dict[str, Any]] | None = Field(
        default=None,
        description="function, namespace and custom tools; other (hosted) tools are left out "
        "of the prompt and named in the x-areal-left-out header",
    )
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(
        default=None, description="format: json_schema, json_object; verbosity (left out)"
    )
    include: list[str] | None = Field(
        default=None,
        description="message.output_text.logprobs; reasoning.encrypted_content (always "
        "null); hosted tools' outputs (left out)",
    )
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = Field(
        default=None,
        description="effort -> chat_template_kwargs.reasoning_effort; summary: the reasoning text",
    )
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    service_tier: str | None = Field(default=None, description="auto, default; others left out")
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None


class ResponseObject(_Open):
    """A Response, as `POST /v1/responses` answered it and `GET /v1/responses/{id}` returns
    it (a stream: `text/event-stream` of `response.*` events, the last one holding this)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    previous_response_id: str | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class DeletedResponse(_Closed):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# --- models ----------------------------------------------------------------------------------


class ModelObject(_Closed):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = Field(description="areal (served by this service) or external")


class ModelObjectList(_Closed):
    object: Literal["list"] = "list"
    data: list[ModelObject]


# --- Anthropic messages ----------------------------------------------------------------------


class AnthropicMessage(_Open):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class _MessagesBody(_Closed):
    model: str = _model()
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: Literal["standard"] | None = None
    context_management: dict[str, Any] | None = Field(
        default=None, description="accepted where its edits remove nothing (no edit is applied)"
    )
    mcp_servers: list[dict[str, Any]] | None = Field(
        default=None, description="left out (x-areal-left-out): areal connects to no MCP server"
    )
    container: str | dict[str, Any] | None = Field(
        default=None, description="left out (x-areal-left-out): areal runs no container"
    )


class MessagesRequest(_MessagesBody):
    """`POST /v1/messages`: Anthropic's Messages body (key as `x-api-key` or a bearer)."""

    model_config = _examples({"model": MODEL_EXAMPLE, "messages": _HI, "max_tokens": 32})
    max_tokens: int = Field(ge=1)


class CountTokensRequest(_MessagesBody):
    """`POST /v1/messages/count_tokens`: a Messages body (`max_tokens` not needed), counted
    with the model's own chat template and tokenizer; nothing is generated or recorded."""

    model_config = _examples({"model": MODEL_EXAMPLE, "messages": _HI})
    max_tokens: int | None = Field(default=None, ge=1)


class MessageTokensCount(_Closed):
    input_tokens: int = Field(description="the prompt's tokens, generation prompt included")


class MessageObject(_Open):
    """An Anthropic message (a stream: `text/event-stream` of Anthropic's events)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    usage: dict[str, Any]
