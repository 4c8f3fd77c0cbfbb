"""The JSON bodies of the admin, RL, control and agent-session APIs, as pydantic models.

They are what FastAPI validates a request against and what the OpenAPI document
(`GET /openapi.json`, admin key) shows; docs/services.md describes the same shapes.

Requests are strict (`"3"` is no integer, `1` no boolean, as before these models existed) and
ignore unknown fields (as the hand-written checks did). Where a field took `null` to mean
"not given", it still does (`X | None`). The endpoints answer with the exact bytes they always
sent (orjson, keys absent rather than null where a key only applies to one kind); the response
models document those bytes and the tests check real answers against them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

MAX_GROUP_SIZE = 1024

ExportStyle = Literal["concat", "individual"]
SideCalls = Literal["include", "exclude", "only"]
Health = Literal["unknown", "healthy", "unhealthy", "draining"]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    # "forbid": a key the endpoint sends but the model lacks fails the schema test.
    model_config = ConfigDict(extra="forbid")


def _host_port(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PydanticCustomError(
            "invalid_address", "must be host:port, got {address!r}", {"address": address}
        )
    return address


# Surrounding blanks are dropped; what is left must not be empty.
Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
Address = Annotated[
    Name, AfterValidator(_host_port), Field(description="host:port", examples=["127.0.0.1:50061"])
]
Id = Annotated[str, StringConstraints(min_length=1)]
# A model name as the CLI accepts one (docs/cli.md, "Names"): 1-64 letters, digits, `.`, `_`,
# `-`, starting with a letter or digit. It is a path segment (`/admin/models/{name}`) and a
# metrics label, so a slash, a blank or a control character has no place in it.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _model_name(name: str) -> str:
    if not MODEL_NAME.fullmatch(name):
        raise PydanticCustomError(
            "invalid_model_name",
            "a model name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit, got '{name}'",
            {"name": name[:80]},
        )
    return name


ModelName = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1),
    AfterValidator(_model_name),
    Field(
        description="1-64 letters, digits, `.`, `_`, `-`; starts with a letter or digit",
        examples=["tiny"],
    ),
]


# --- admin API (admin.py) ---------------------------------------------------------------------


class ProxyRef(_Request):
    proxy_id: Name
    address: Address


def _unique_ids(proxies: list[ProxyRef]) -> list[ProxyRef]:
    ids = [p.proxy_id for p in proxies]
    if len(set(ids)) != len(ids):
        raise PydanticCustomError("duplicate_proxy_id", "proxy ids must be unique")
    return proxies


class RegisterModelRequest(_Request):
    """An internal model served by data proxies, or an external OpenAI-compatible one."""

    name: ModelName
    kind: Literal["internal", "external"] = "internal"
    proxies: Annotated[list[ProxyRef], AfterValidator(_unique_ids)] = Field(
        default_factory=list, description="internal (at least one): the replicas' data proxies"
    )
    base_url: Name | None = Field(
        None, description="external (required): the upstream's OpenAI base URL"
    )
    api_key: Annotated[str, StringConstraints(strip_whitespace=True)] | None = Field(
        None, description="external: the upstream's key (never returned)"
    )
    upstream_model: Annotated[str, StringConstraints(strip_whitespace=True)] | None = Field(
        None, description="external: the upstream's name for the model (default: `name`)"
    )


class ProxyOut(_Response):
    proxy_id: str
    address: str


class RegisteredModel(_Response):
    name: str
    kind: Literal["internal", "external"]
    proxies: list[ProxyOut] | None = Field(None, description="internal models only")
    base_url: str | None = Field(None, description="external models only")
    upstream_model: str | None = Field(None, description="external models only")


class ModelWorker(_Response):
    proxy_id: str
    address: str
    health: Health
    inflight_requests: int
    inflight_tokens: int
    sessions: int


class ModelEntry(_Response):
    name: str
    kind: Literal["unspecified", "internal", "external"]
    created: int
    base_url: str | None = Field(None, description="external models only")
    upstream_model: str | None = Field(None, description="external models only")
    workers: list[ModelWorker]


class ModelList(_Response):
    models: list[ModelEntry]


class DeregisteredModel(_Response):
    name: str
    proxy_ids: list[str]


class AddedProxy(_Response):
    name: str
    proxy_id: str
    address: str


class Worker(_Response):
    proxy_id: str
    address: str
    model: str
    kind: Literal["unspecified", "inference", "agent"]
    health: Health
    inflight_requests: int
    inflight_tokens: int
    sessions: int
    last_seen_unix_ms: int
    last_error: str
    labels: dict[str, str]
    tool_call_parser: str = Field(description="the tool-call parser in force; '': none")
    reasoning_parser: str = Field(description="'': none")
    default_tool_prompt: bool = Field(
        description="the chat template does not render `tools`: the proxy writes them in"
    )


class WorkerList(_Response):
    workers: list[Worker]


# --- generation control (control.py) ------------------------------------------------------------


class ControlTarget(_Request):
    """Which inference proxies: all, one model's, or one worker (a proxy id)."""

    model: str | None = None
    worker: str | None = None


class SetVersionRequest(ControlTarget):
    version: int = Field(ge=0)


class UpdateWeightsRequest(ControlTarget):
    path: Id = Field(description="the checkpoint the engines load")
    version: int = Field(-1, description="the new version; -1: the current one + 1")


class WorkerControl(_Response):
    proxy_id: str
    model: str
    paused: bool | None = Field(None, description="absent when this worker failed")
    version: int | None = Field(None, description="absent when this worker failed")
    message: str | None = Field(None, description="absent when this worker failed")
    error: str | None = Field(None, description="only when this worker failed")


class ControlResult(_Response):
    action: Literal["pause", "continue", "set_version", "update_weights"]
    workers: list[WorkerControl]
    version: int | None = Field(description="the highest version reported; null if none")


class RetireRequest(_Request):
    drain_timeout: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="seconds the requests on the worker's engine may take to finish before "
        "they move to another replica",
    )


class RetiredWorker(_Response):
    proxy_id: str
    model: str
    finished: int = Field(description="requests that finished on the engine during the drain")
    moved: int = Field(description="requests moved to another replica at the drain timeout")
    failed: int = Field(description="requests that could not move (migration_failed)")
    message: str


# --- RL API (rl.py) ----------------------------------------------------------------------------


# The longest a start may wait for admission (seconds).
MAX_ADMISSION_WAIT_S = 600.0


class StartSessionRequest(_Request):
    task_id: str | None = None
    group_size: int = Field(1, ge=1, le=MAX_GROUP_SIZE)
    model: str | None = Field(None, description="may be omitted when one model is served")
    wait_s: float = Field(
        0.0,
        ge=0.0,
        le=MAX_ADMISSION_WAIT_S,
        allow_inf_nan=False,
        description="wait up to this many seconds for the model's admission bounds to "
        "admit the group, then 429; 0: answer at once",
    )


class AdmissionUpdate(_Request):
    """`PUT /admin/models/{name}/admission`: a field given sets that bound, `null` removes
    it, a field left out keeps it."""

    max_staleness: int | None = Field(None, ge=0, description="η, in weight versions")
    batch_size: int | None = Field(None, ge=1, description="samples the trainer takes a version")
    max_concurrent_rollouts: int | None = Field(None, ge=1)
    reset_consumed: bool = Field(False, description="forget the consumed count (a new run)")


class AdmissionStatus(_Response):
    model: str
    max_staleness: int | None
    batch_size: int | None
    max_concurrent_rollouts: int | None
    version: int
    running: int
    ended: int
    consumed: int
    capacity_left: int | None = Field(description="null: no bound")
    limited_by: Literal["capacity", "staleness"] | None
    admitted_total: int
    refused_total: int
    waiting: int


class AdmissionList(_Response):
    models: list[AdmissionStatus]


class SessionCredentials(_Response):
    session_id: str
    session_api_key: str


class StartedGroup(_Response):
    group_id: str
    task_id: str
    model: str
    sessions: list[SessionCredentials]


class SetRewardRequest(_Request):
    reward: float = Field(allow_inf_nan=False)
    session_id: str | None = Field(None, description="with the admin key: the session")
    interaction_id: str | None = Field(None, description="default: the session's last one")


class RewardResult(_Response):
    session_id: str
    interaction_id: str
    reward: float


class EndSessionRequest(_Request):
    session_ids: list[Id] | None = Field(None, description="with the admin key: the sessions")
    failure: Annotated[str, StringConstraints(pattern=r"^[a-z0-9_.:-]{1,64}$")] | None = Field(
        None,
        description="the sessions failed, and why (a short code: engine_refusal, timeout, "
        "client_error, ...): kept with them, on their rows and in export summaries, and what "
        "export group policies count as failed; also for a session already ended, once",
    )


class EndedSessions(_Response):
    ended: int


class ExportRequest(_Request):
    group_id: str | None = None
    session_ids: list[Id] | None = None
    style: ExportStyle | None = Field(
        "concat", description="concat: one row per chain; individual: one row per interaction"
    )
    side_calls: SideCalls | None = Field(
        "include",
        description="rows of side calls (`side`): include (marked), exclude, or only them",
    )
    discount: float = Field(1.0, ge=0.0, le=1.0)
    remove_session: bool = False
    format: Literal["json", "jsonl"] | None = Field(
        None, description="jsonl: JSON lines, as with `Accept: application/x-ndjson`"
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="a staleness bound in weight versions: rows past it are dropped (or "
        "marked, `stale`); none by default",
    )
    stale: Literal["drop", "mark"] | None = Field(
        "drop", description="rows past max_staleness: drop them, or mark them `stale: true`"
    )
    mask_stale_tokens: bool = Field(
        False,
        description="with max_staleness: trainable tokens older than the current version "
        "minus max_staleness get loss_mask 0; only rows left with none are past the bound",
    )
    drop_incomplete_group: bool = Field(
        False,
        description="per group, all or nothing: none of its rows when a member failed or "
        "has no row left",
    )
    min_usable_group_size: int = Field(
        0,
        ge=0,
        le=MAX_GROUP_SIZE,
        description="per group: the usable members' rows (not failed, a row left), or none "
        "when fewer than this many are usable; 0: no such policy",
    )


def _no_default(schema: dict[str, Any]) -> None:
    # An optional key is absent, never null: the document shows no `"default": null`.
    schema.pop("default", None)


class ToolCallCounts(_Response):
    declared: int
    called: int
    parsed: int


class TrajectoryRow(_Response):
    """One exported row, as the proxy makes it (areal_proxy.recording.export).

    The canonical schema is proto/rl_row.schema.json; tests/test_rl_row_schema.py holds this
    model (fields, types, required-ness, descriptions) to it.
    """

    input_ids: list[int] = Field(
        description="The row's token ids: the prompt, then the output (its stop token included)."
    )
    loss_mask: list[int] = Field(
        description="Per token: 1 on generated (trainable) tokens, 0 on prompt tokens and on "
        "template text between the turns of a concat row."
    )
    logprobs: list[float] = Field(
        description="Per token: the engine's logprob of a generated token; 0.0 where "
        "loss_mask is 0."
    )
    versions: list[int] = Field(
        description="Per token: the weight version that generated it; -1 where loss_mask is 0."
    )
    reward: float = Field(
        description="The reward after discount (r_i += discount * r_{i+1} over the session's "
        "turns); an unrewarded turn counts as 0."
    )
    session_id: str = Field(description="The RL session the row was recorded on.")
    group_id: str = Field(description="The session's group (a GRPO group).")
    task_id: str = Field(description="The task the session's group was started for.")
    interaction_id: str = Field(
        description="The interaction the row ends with: a chat completion's or completion's "
        "id, `<response id>-<index>` for a choice of an n > 1 request."
    )
    interaction_ids: list[str] = Field(
        description="The interactions whose outputs the row trains, in order: the chain of "
        "turns (style concat) or the one interaction (style individual)."
    )
    response_id: str = Field(
        description="The OpenAI response the interaction is a choice of (the interaction id "
        "itself for a request with one choice)."
    )
    choice_index: int = Field(
        description="Which choice of that response the interaction is, from 0."
    )
    replicas: list[tuple[int, str]] = Field(
        description="Which replica generated which tokens: [index, proxy id] pairs, index "
        "ascending: from input_ids[index] on, until the next pair, the generated tokens "
        "(loss_mask 1) came from that proxy's engine (the recording proxy's own id for its own "
        "engine). One pair, at the first generated token, unless the request migrated to "
        "another replica mid-generation; prompt tokens are not attributed; in a concat row, "
        "each turn's pairs sit where its output does."
    )
    finish_reason: str = Field(
        description="Why the interaction's generation stopped: stop, length, tool_calls, ..."
    )
    chain_id: str = Field(
        description=(
            "The chain the row belongs to (the interaction id of its first turn): a run of turns "
            "each continuing the exact prompt + sampled ids of the one before. A concat row is "
            "one chain; an individual row is one turn of one."
        )
    )
    chain_reason: str = Field(
        description=(
            "Why the chain started: root (the session's first conversation), fork (it continues a "
            "turn another turn had already continued, or is a sibling choice), history_edited, "
            "not_cached, render_changed or tokenizer_unsupported (the prompt builder's fallback), "
            "retokenized (its parent turn was rendered into other ids), unlinked (it extends no "
            "recorded turn: a completion), side_call or main_call (marked otherwise than the "
            "chain it continues), prefix_mismatch (split off where a turn's prefix differs from "
            "its certified prompt)."
        )
    )
    parent_chain: str = Field(
        description=(
            "The chain this one came from: the one holding its first turn's lineage parent, else "
            "the one whose turn was recorded last before it started; empty for a chain with none "
            "(root)."
        )
    )
    side: bool = Field(
        description=(
            "A side call (a title, a summary): marked so by the request's x-areal-call header, "
            "or, unmarked, a chain whose first request declares no tools in a session where "
            "another chain declares some."
        )
    )
    spans: list[tuple[int, int, str]] = Field(
        description=(
            "The trained spans, one per turn whose output the row trains: [start, end, "
            "prompt_hash], input_ids[start:end] the turn's sampled ids, prompt_hash the "
            "BLAKE2b-128 hex of the exact prompt ids they were sampled under (int32 "
            "little-endian), which input_ids[:start] hashes to (areal_client.spans); empty for a "
            "turn recorded before prompt hashes existed."
        )
    )
    tool_calls: ToolCallCounts = Field(
        description=(
            "How the row's turns called tools: declared (the most tools one of their requests "
            "declared), called (tool calls their outputs made), parsed (of those, the calls the "
            "tool-call parser read; the rest were left in the content as text, or cut off)."
        )
    )
    min_version: int = Field(
        description=(
            "The oldest weight version of the row's trainable tokens as recorded (loss_mask "
            "1 before any masking); -1 when it has none."
        )
    )
    max_version: int = Field(
        description=(
            "The newest weight version of the row's trainable tokens as recorded; -1 when "
            "it has none."
        )
    )
    staleness: int = Field(
        description=(
            "The proxy's current weight version at export minus min_version, never below 0; "
            "0 for a row with no trainable token."
        )
    )
    stale: bool = Field(
        description=(
            "Past the export's max_staleness, and kept because the export asked stale=mark; "
            "false otherwise."
        )
    )
    failure: str = Field(
        description=(
            "Why the row's session failed, as its end said (a short code: an engine "
            "refusal, a timeout, a client's failure); empty for a session that did not "
            "fail."
        )
    )
    agent_session_id: str | SkipJsonSchema[None] = Field(
        None,
        description="Agent mode only: the agent session the row was exported for.",
        json_schema_extra=_no_default,
    )


class FailedSession(_Response):
    session_id: str
    group_id: str
    failure: str = Field(description="why it failed, as its end said")


class ExportSummary(_Response):
    """What an export kept and held back (docs/services.md, "Export summary")."""

    version: int = Field(description="the current weight version staleness was measured at")
    exported: int = Field(description="rows exported (marked_stale among them)")
    marked_stale: int = Field(description="rows past max_staleness, exported marked stale")
    dropped_stale: int = Field(description="rows past max_staleness, dropped")
    masked_tokens: int = Field(description="trainable tokens masked as older than the bound")
    dropped_groups: int = Field(description="groups a group policy dropped whole")
    dropped_group_rows: int = Field(description="the rows of those groups")
    dropped_failed_rows: int = Field(
        description="rows of failed members left out of groups kept (min_usable_group_size)"
    )
    failed: list[FailedSession] = Field(description="the export's failed sessions")
    staleness: dict[str, int] = Field(description="exported rows by staleness")


class ExportResult(_Response):
    count: int
    rows: list[TrajectoryRow]
    summary: ExportSummary | None = Field(
        None, description="what the export kept and held back (absent from an older proxy)"
    )
    export_id: str | None = Field(
        None,
        description="with remove_session: POST /rl/ack_export with it once every row is "
        "safely received; the sessions are removed only then",
    )


class AckExportRequest(_Request):
    export_id: Annotated[str, StringConstraints(min_length=1, max_length=8192)]


class AckExportResult(_Response):
    export_id: str
    removed: list[str] = Field(description="the sessions removed (their pins released)")
    kept: list[str] = Field(
        description="sessions that gained a turn or reward after the export read them: kept, "
        "to be exported again"
    )


class PromptPaths(_Response):
    """How a session's chat prompts were built (areal_proxy.prompt.incremental)."""

    incremental: int = Field(description="chat turns whose prompt continued the previous turn's")
    full: int = Field(
        description="chat turns whose prompt was built whole: the session's first, and each "
        "fallback"
    )
    fallbacks: dict[str, int] = Field(
        description="the fallbacks among `full`, by reason: `new_conversation` (a turn "
        "extending no earlier one: a sub-agent, a title call), `history_edited`, `not_cached`, "
        "`render_changed`, `boundary_unknown`, `tokenizer_unsupported`"
    )
    cached: bool = Field(
        description="the session's last turn is in the proxy's turn cache (a next turn that "
        "extends it may continue its prompt)"
    )
    last_prompt_tokens: int | None = Field(
        description="the prompt length of that cached turn; null when none is cached"
    )


class SessionStatus(_Response):
    session_id: str
    group_id: str
    task_id: str
    model: str
    created_at: float = Field(description="unix seconds")
    last_active_at: float = Field(description="unix seconds: the last turn or reward")
    ended: bool
    interactions: int = Field(description="the interactions recorded (every choice of a turn)")
    prompt: PromptPaths


# --- agent mode (agent/sessions.py, agent/pairs.py) ----------------------------------------------


class CreateSessionRequest(_Request):
    metadata: dict[str, Any] | None = Field(None, description="passed to the agent")


class CreatedSession(_Response):
    session_id: str
    session_api_key: str
    rl_session_id: str | None = Field(None, description="when linked to an inference service")


class ClosedSession(_Response):
    session_id: str
    closed: bool


class SessionHistory(_Response):
    session_id: str
    history: list[Any]


class AgentRewardRequest(_Request):
    reward: float = Field(allow_inf_nan=False)
    interaction_id: str | None = Field(None, description="default: the session's last one")


class AgentExportRequest(_Request):
    # As ExportRequest's (the session is the path's).
    style: ExportStyle | None = "concat"
    side_calls: SideCalls | None = "include"
    discount: float = Field(1.0, ge=0.0, le=1.0)
    remove_session: bool = False


class AgentExportResult(_Response):
    # As ExportResult; the acknowledgement is POST /v1/sessions/{session_id}/ack_export.
    count: int
    rows: list[TrajectoryRow]
    export_id: str | None = Field(
        None,
        description="with remove_session: POST /v1/sessions/{session_id}/ack_export with it "
        "once every row is safely received; the session's RL records are removed only then",
    )


class AddPairRequest(_Request):
    proxy_id: Name
    address: Address


class AddedPair(_Response):
    proxy_id: str
    address: str
    model: str


class RemovedPair(_Response):
    proxy_id: str
    removed: bool


class PairList(_Response):
    pairs: list[Worker]
