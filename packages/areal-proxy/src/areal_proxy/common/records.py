"""Plain records of what a session holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Interaction:
    interaction_id: str
    session_id: str
    seq: int
    # The request's messages (chat) or prompt (completions), as sent.
    messages: list[dict[str, Any]] | str
    # The assistant message the proxy returned (chat), or the text.
    response: dict[str, Any] | str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    parent_id: str | None = None
    reward: float | None = None
    created_at: float = 0.0
    finished_at: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    # Index in prompt_ids where this turn's own tokens start, when the prompt
    # continues the parent's exact token sequence (concat template); 0 otherwise.
    inherited: int = 0
    # Storage only: how many leading prompt ids are the parent's prompt + output ids, and how
    # many leading messages are the parent's messages + answer; the store keeps the rest.
    shared_tokens: int = 0
    shared_messages: int = 0
    # The OpenAI response this interaction is a choice of, and which choice ("" and 0 for
    # rows recorded before choices were kept: their interaction id is the response id).
    response_id: str = ""
    choice_index: int = 0
    # How the chat prompt was built: "incremental" (continued the previous turn's), "full"
    # (the session's first prompt) or "full:<reason>" (a fallback; prompt/incremental.py).
    prompt_path: str = ""
    # Which proxy's engine generated which output tokens, as runs: (index in output_ids of the
    # run's first token, proxy id), in order, each run a different proxy from the one before
    # (a request that migrated mid-generation has several). Empty: all by the recording
    # proxy (one run), as every row recorded before migration existed reads.
    replicas: list[tuple[int, str]] = field(default_factory=list)
    # What the request said it is to the trajectory (the `x-areal-call` header, Envelope
    # .call_kind): "side", "main", or "" (not said: the export decides; recording/chains.py).
    call_kind: str = ""
    # The request's declared tools; the tool calls the output made, and how many of them the
    # tool-call parser read (one it could not read is left in the content, or dropped when
    # the output was cut inside it). 0 for rows recorded before these were kept.
    tools_declared: int = 0
    tool_calls_made: int = 0
    tool_calls_parsed: int = 0
    # spans.prompt_hash of prompt_ids, taken as the turn was recorded: what the
    # export certifies each trained span against ("" for rows recorded before).
    prompt_hash: str = ""


@dataclass(slots=True)
class Session:
    session_id: str
    group_id: str
    task_id: str
    key_hash: str
    model: str
    created_at: float
    last_active_at: float
    ended_at: float | None = None
    # When a reward closed the trajectory: turns and rewards are refused after
    # reward_closed_at + set_reward_finish_timeout.
    last_reward_at: float | None = None
    n_interactions: int = 0
    # Why the session failed, as the client said when ending it ("engine_refusal",
    # "timeout", ...); "" for a session that did not fail. Export group policies count it.
    failure: str = ""
