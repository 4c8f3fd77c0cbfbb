"""Typed results of the RL and admin APIs, each parsed from the gateway's JSON.

Parsing checks every field a result needs and raises `InvalidResponseError` naming it, so a
gateway of another version fails at the call, not later inside a trainer's loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from areal_client.errors import InvalidResponseError
from areal_client.spans import uncertified_spans

T = TypeVar("T")


def _get(doc: Any, key: str, kind: type[T] | tuple[type, ...], where: str) -> T:
    if not isinstance(doc, dict):
        raise InvalidResponseError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if key not in doc:
        raise InvalidResponseError(f"{where}: missing field {key!r}")
    value = doc[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int in Python; a true/false where a number belongs is a wrong answer.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise InvalidResponseError(
            f"{where}: field {key!r} should be {_kind_name(kind)}, got {value!r:.80}"
        )
    return value  # type: ignore[return-value]


def _opt(doc: Any, key: str, kind: type[T], where: str) -> T | None:
    if isinstance(doc, dict) and doc.get(key) is None:
        return None
    return _get(doc, key, kind, where)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _number(doc: Any, key: str, where: str) -> float:
    return float(_get(doc, key, (int, float), where))


def _items(doc: Any, key: str, where: str) -> list[Any]:
    return _get(doc, key, list, where)


def _replicas(doc: Any, key: str, where: str) -> list[tuple[int, str]]:
    """A list of [integer, string] pairs, as tuples."""
    out = []
    for pair in _items(doc, key, where):
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[0], int)
            and not isinstance(pair[0], bool)
            and isinstance(pair[1], str)
        ):
            raise InvalidResponseError(
                f"{where}: field {key!r} should hold [integer, string] pairs, got {pair!r:.80}"
            )
        out.append((pair[0], pair[1]))
    return out


def _spans(doc: Any, key: str, where: str) -> list[tuple[int, int, str]]:
    """A list of [integer, integer, string] triples, as tuples."""
    out = []
    for span in _items(doc, key, where):
        if not (
            isinstance(span, list)
            and len(span) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) for x in span[:2])
            and isinstance(span[2], str)
        ):
            raise InvalidResponseError(
                f"{where}: field {key!r} should hold [integer, integer, string] triples, "
                f"got {span!r:.80}"
            )
        out.append((span[0], span[1], span[2]))
    return out


def _count(doc: Any, key: str, where: str) -> int:
    """An optional integer field (load figures, timestamps): absent or null is 0."""
    return _opt(doc, key, int, where) or 0


# -- RL API ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """One RL session: chats made with `api_key` are recorded on it."""

    session_id: str
    api_key: str = field(repr=False)  # a credential: kept out of logs and tracebacks
    group_id: str
    base_url: str

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    def openai(self, **kwargs: Any) -> Any:
        """An `openai.OpenAI` client whose calls are recorded on this session.

        Needs the `openai` extra (`pip install 'areal-client[openai]'`). Keyword arguments go
        to the SDK (`max_retries`, `timeout`, `http_client`, ...).
        """
        return _openai_module().OpenAI(
            base_url=self.openai_base_url, api_key=self.api_key, **kwargs
        )

    def async_openai(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` client bound to this session (needs the `openai` extra)."""
        return _openai_module().AsyncOpenAI(
            base_url=self.openai_base_url, api_key=self.api_key, **kwargs
        )


def _openai_module() -> Any:
    try:
        import openai
    except ImportError as e:
        raise ImportError(
            "Session.openai() needs the OpenAI SDK: pip install 'areal-client[openai]'"
        ) from e
    return openai


@dataclass(frozen=True)
class Group:
    """Sessions started together for one task (a GRPO group), all on one proxy."""

    group_id: str
    task_id: str
    model: str
    sessions: list[Session]

    @classmethod
    def from_json(cls, doc: Any, base_url: str) -> Group:
        w = "start_session"
        group_id = _get(doc, "group_id", str, w)
        sessions = [
            Session(
                session_id=_get(s, "session_id", str, f"{w}.sessions[{i}]"),
                api_key=_get(s, "session_api_key", str, f"{w}.sessions[{i}]"),
                group_id=group_id,
                base_url=base_url,
            )
            for i, s in enumerate(_items(doc, "sessions", w))
        ]
        return cls(group_id, _get(doc, "task_id", str, w), _get(doc, "model", str, w), sessions)


@dataclass(frozen=True)
class Reward:
    """What `set_reward` recorded: which interaction got which reward."""

    session_id: str
    interaction_id: str
    reward: float

    @classmethod
    def from_json(cls, doc: Any) -> Reward:
        w = "set_reward"
        return cls(
            _get(doc, "session_id", str, w),
            _get(doc, "interaction_id", str, w),
            _number(doc, "reward", w),
        )


_ROW_FIELDS = (
    "input_ids",
    "loss_mask",
    "logprobs",
    "versions",
    "reward",
    "session_id",
    "group_id",
    "task_id",
    "interaction_id",
    "interaction_ids",
    "response_id",
    "choice_index",
    "replicas",
    "finish_reason",
    "chain_id",
    "chain_reason",
    "parent_chain",
    "side",
    "spans",
    "tool_calls",
    "min_version",
    "max_version",
    "staleness",
    "stale",
    "failure",
)
# Present in agent mode only (absent, never null, elsewhere).
_OPTIONAL_ROW_FIELDS = ("agent_session_id",)


@dataclass(frozen=True)
class ToolCallCounts:
    """How a row's turns called tools: `declared` (the most tools one of their requests
    declared), `called` (tool calls their outputs made), `parsed` (of those, the calls the
    proxy's tool-call parser read; the rest stayed in the content as text, or were cut off)."""

    declared: int
    called: int
    parsed: int

    @classmethod
    def from_json(cls, doc: Any, where: str) -> ToolCallCounts:
        return cls(
            _get(doc, "declared", int, where),
            _get(doc, "called", int, where),
            _get(doc, "parsed", int, where),
        )


@dataclass(frozen=True)
class Trajectory:
    """One exported row; token lists are aligned. Its fields are those of the canonical
    schema, proto/rl_row.schema.json (docs/services.md, "Exported row").

    `extra` keeps any field this version does not know, so `to_dict()` gives back the row
    exactly as the gateway sent it.
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    session_id: str
    group_id: str
    task_id: str
    interaction_id: str
    interaction_ids: list[str]
    response_id: str
    choice_index: int
    # Which replica (proxy id) generated which tokens: (index into input_ids, proxy id) runs,
    # each on until the next; one run unless the request migrated mid-generation.
    replicas: list[tuple[int, str]]
    finish_reason: str
    # The chain of turns the row belongs to (its first interaction's id), why it started
    # ("root", "fork", "history_edited", ...) and the chain it came from ("" for none).
    chain_id: str
    chain_reason: str
    parent_chain: str
    # A side call (a title, a summary): by its `x-areal-call` header, or the proxy's default.
    side: bool
    # Certified spans: (start, end, prompt hash), input_ids[start:end] sampled under exactly
    # input_ids[:start] (`uncertified_spans()` checks; areal_client.spans).
    spans: list[tuple[int, int, str]]
    tool_calls: ToolCallCounts
    # The oldest and newest weight version of the trainable tokens as recorded (-1: none),
    # and the current version at export minus the oldest (docs/services.md, "Staleness").
    min_version: int
    max_version: int
    staleness: int
    # Past the export's max_staleness, kept because it asked stale="mark".
    stale: bool
    # Why the session failed, as its end said ("" when it did not).
    failure: str
    agent_session_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Any, index: int = 0) -> Trajectory:
        w = f"export row {index}"
        known = (*_ROW_FIELDS, *_OPTIONAL_ROW_FIELDS)
        row = cls(
            input_ids=_items(doc, "input_ids", w),
            loss_mask=_items(doc, "loss_mask", w),
            logprobs=_items(doc, "logprobs", w),
            versions=_items(doc, "versions", w),
            reward=_number(doc, "reward", w),
            session_id=_get(doc, "session_id", str, w),
            group_id=_get(doc, "group_id", str, w),
            task_id=_get(doc, "task_id", str, w),
            interaction_id=_get(doc, "interaction_id", str, w),
            interaction_ids=_items(doc, "interaction_ids", w),
            response_id=_get(doc, "response_id", str, w),
            choice_index=_get(doc, "choice_index", int, w),
            replicas=_replicas(doc, "replicas", w),
            finish_reason=_get(doc, "finish_reason", str, w),
            chain_id=_get(doc, "chain_id", str, w),
            chain_reason=_get(doc, "chain_reason", str, w),
            parent_chain=_get(doc, "parent_chain", str, w),
            side=_get(doc, "side", bool, w),
            spans=_spans(doc, "spans", w),
            tool_calls=ToolCallCounts.from_json(
                _get(doc, "tool_calls", dict, w), f"{w}.tool_calls"
            ),
            min_version=_get(doc, "min_version", int, w),
            max_version=_get(doc, "max_version", int, w),
            staleness=_get(doc, "staleness", int, w),
            stale=_get(doc, "stale", bool, w),
            failure=_get(doc, "failure", str, w),
            agent_session_id=(
                _get(doc, "agent_session_id", str, w) if "agent_session_id" in doc else None
            ),
            extra={k: v for k, v in doc.items() if k not in known},
        )
        n = len(row.input_ids)
        if not len(row.loss_mask) == len(row.logprobs) == len(row.versions) == n:
            raise InvalidResponseError(
                f"{w}: token lists differ in length (input_ids {n}, loss_mask "
                f"{len(row.loss_mask)}, logprobs {len(row.logprobs)}, versions {len(row.versions)})"
            )
        return row

    def uncertified_spans(self) -> list[tuple[int, int, str]]:
        """The spans whose prefix in `input_ids` is not the prompt they were sampled under
        (or that carry no prompt hash): empty for a row that is exactly what was sampled."""
        return uncertified_spans(self.input_ids, self.spans)

    @property
    def output_versions(self) -> list[int]:
        """The weight versions that produced this row's trainable tokens."""
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _ROW_FIELDS}
        out["replicas"] = [[i, r] for i, r in self.replicas]
        out["spans"] = [list(span) for span in self.spans]
        out["tool_calls"] = {
            "declared": self.tool_calls.declared,
            "called": self.tool_calls.called,
            "parsed": self.tool_calls.parsed,
        }
        if self.agent_session_id is not None:
            out["agent_session_id"] = self.agent_session_id
        out.update(self.extra)
        return out


STALE_ACTIONS = ("drop", "mark")


@dataclass(frozen=True)
class ExportSelection:
    """Which rows an export keeps (docs/services.md, "Staleness"); the defaults keep every
    row. `max_staleness`: rows whose staleness is past it are dropped, or with
    `stale="mark"` kept marked `stale`; `mask_stale_tokens`: tokens older than the bound get
    loss_mask 0 instead (only rows left with none are past it). Per group:
    `drop_incomplete_group` (all or nothing) or `min_usable_group_size` (the members that did
    not fail and kept a row, or none when fewer). Checked when made."""

    max_staleness: int | None = None
    stale: str = "drop"
    mask_stale_tokens: bool = False
    drop_incomplete_group: bool = False
    min_usable_group_size: int = 0

    def __post_init__(self) -> None:
        n = self.max_staleness
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"max_staleness must be an integer >= 0, got {n!r}")
        if self.stale not in STALE_ACTIONS:
            raise ValueError(f"stale must be one of {', '.join(STALE_ACTIONS)}, got {self.stale!r}")
        for name in ("mask_stale_tokens", "drop_incomplete_group"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.mask_stale_tokens and n is None:
            raise ValueError("mask_stale_tokens needs max_staleness")
        k = self.min_usable_group_size
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"min_usable_group_size must be an integer >= 0, got {k!r}")
        if k and self.drop_incomplete_group:
            raise ValueError("give drop_incomplete_group or min_usable_group_size, not both")

    def to_body(self) -> dict[str, Any]:
        """The request's fields that differ from the defaults (an older gateway then gets the
        same request as before when nothing is asked)."""
        defaults = ExportSelection()
        return {
            k: v
            for k in (
                "max_staleness",
                "stale",
                "mask_stale_tokens",
                "drop_incomplete_group",
                "min_usable_group_size",
            )
            if (v := getattr(self, k)) != getattr(defaults, k)
        }


@dataclass(frozen=True)
class FailedSession:
    """A session of an export that failed, and why (as its end said)."""

    session_id: str
    group_id: str
    failure: str


@dataclass(frozen=True)
class ExportSummary:
    """What an export kept and held back (docs/services.md, "Export summary"): rows
    `exported` (`marked_stale` among them), `dropped_stale`, tokens masked, groups dropped
    whole and their rows, failed members' rows left out, the failed sessions, and the
    exported rows by staleness, all at weight `version`."""

    version: int
    exported: int
    marked_stale: int
    dropped_stale: int
    masked_tokens: int
    dropped_groups: int
    dropped_group_rows: int
    dropped_failed_rows: int
    failed: list[FailedSession]
    staleness: dict[int, int]

    @classmethod
    def from_json(cls, doc: Any) -> ExportSummary:
        w = "export summary"
        ints = {
            k: _get(doc, k, int, w)
            for k in (
                "version",
                "exported",
                "marked_stale",
                "dropped_stale",
                "masked_tokens",
                "dropped_groups",
                "dropped_group_rows",
                "dropped_failed_rows",
            )
        }
        failed = [
            FailedSession(
                _get(f, "session_id", str, w),
                _get(f, "group_id", str, w),
                _get(f, "failure", str, w),
            )
            for f in _items(doc, "failed", w)
        ]
        hist = _get(doc, "staleness", dict, w)
        try:
            staleness = {int(k): int(v) for k, v in hist.items()}
        except (TypeError, ValueError) as e:
            raise InvalidResponseError(f"{w}: staleness must map integers to counts") from e
        return cls(**ints, failed=failed, staleness=staleness)


@dataclass(frozen=True)
class ExportResult:
    """The rows of one `export_trajectories` call."""

    count: int
    rows: list[Trajectory]
    # With remove_session: the id to acknowledge (`ack_export`) once the rows are safe; the
    # sessions are removed only then. `export` does it itself before it returns.
    export_id: str | None = None
    # What the export kept and held back (None from an older gateway).
    summary: ExportSummary | None = None

    @classmethod
    def from_json(cls, doc: Any) -> ExportResult:
        rows = [Trajectory.from_json(r, i) for i, r in enumerate(_items(doc, "rows", "export"))]
        count = doc.get("count", len(rows))
        if count != len(rows):
            raise InvalidResponseError(f"export: count says {count!r}, {len(rows)} rows came")
        export_id = doc.get("export_id")
        if export_id is not None and (not isinstance(export_id, str) or not export_id):
            raise InvalidResponseError(f"export: export_id must be a string, got {export_id!r}")
        summary = doc.get("summary")
        return cls(
            len(rows),
            rows,
            export_id,
            ExportSummary.from_json(summary) if summary is not None else None,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.rows)


@dataclass(frozen=True)
class ExportAck:
    """What `ack_export` removed: `removed` sessions, and `kept` ones (they gained a turn or a
    reward after the export read them; export them again)."""

    export_id: str
    removed: list[str]
    kept: list[str]

    @classmethod
    def from_json(cls, doc: Any) -> ExportAck:
        return cls(
            _get(doc, "export_id", str, "ack_export"),
            [_str(x, "ack_export removed") for x in _items(doc, "removed", "ack_export")],
            [_str(x, "ack_export kept") for x in _items(doc, "kept", "ack_export")],
        )


@dataclass(frozen=True)
class PromptPaths:
    """How a session's chat prompts were built: `incremental` turns continued the previous
    turn's prompt; `full` ones rendered the conversation whole (the session's first, and each
    other, by reason in `fallbacks`: new chains `new_conversation`, `history_edited`,
    `boundary_unknown`; with a parent `not_cached`, `render_changed`; `tokenizer_unsupported`).
    `cached`: the last turn is in the proxy's turn cache, whose prompt has
    `last_prompt_tokens` tokens (None when none is cached)."""

    incremental: int
    full: int
    fallbacks: dict[str, int]
    cached: bool
    last_prompt_tokens: int | None

    @classmethod
    def from_json(cls, doc: Any, where: str) -> PromptPaths:
        fallbacks = _get(doc, "fallbacks", dict, where)
        for reason, n in fallbacks.items():
            if isinstance(n, bool) or not isinstance(n, int):
                raise InvalidResponseError(
                    f"{where}.fallbacks: {reason!r} should be int, got {n!r:.80}"
                )
        return cls(
            incremental=_get(doc, "incremental", int, where),
            full=_get(doc, "full", int, where),
            fallbacks=dict(fallbacks),
            cached=_get(doc, "cached", bool, where),
            last_prompt_tokens=_opt(doc, "last_prompt_tokens", int, where),
        )


@dataclass(frozen=True)
class SessionStatus:
    """A session's status (`session_status`): its interactions, and how their prompts were
    built. Times are unix seconds; an ended session keeps its status."""

    session_id: str
    group_id: str
    task_id: str
    model: str
    created_at: float
    last_active_at: float
    ended: bool
    interactions: int
    prompt: PromptPaths

    @classmethod
    def from_json(cls, doc: Any) -> SessionStatus:
        w = "session_status"
        return cls(
            session_id=_get(doc, "session_id", str, w),
            group_id=_get(doc, "group_id", str, w),
            task_id=_get(doc, "task_id", str, w),
            model=_get(doc, "model", str, w),
            created_at=_number(doc, "created_at", w),
            last_active_at=_number(doc, "last_active_at", w),
            ended=_get(doc, "ended", bool, w),
            interactions=_get(doc, "interactions", int, w),
            prompt=PromptPaths.from_json(_get(doc, "prompt", dict, w), f"{w}.prompt"),
        )


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidResponseError(f"{what}: expected a string, got {value!r:.80}")
    return value


# -- generation control ------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerControl:
    """One worker's outcome of pause/continue/set_version/update_weights."""

    proxy_id: str
    model: str
    paused: bool | None
    version: int | None
    message: str
    error: str | None  # set when this worker failed; the others' fields are then unset

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ControlResult:
    """A control call's outcome: `version` is the highest weight version any worker reports."""

    action: str
    workers: list[WorkerControl]
    version: int | None

    @property
    def ok(self) -> bool:
        return all(w.ok for w in self.workers)

    @classmethod
    def from_json(cls, doc: Any) -> ControlResult:
        w = "control"
        workers = []
        for i, x in enumerate(_items(doc, "workers", w)):
            wi = f"{w}.workers[{i}]"
            error = _opt(x, "error", str, wi)
            workers.append(
                WorkerControl(
                    proxy_id=_get(x, "proxy_id", str, wi),
                    model=str(x.get("model") or ""),
                    paused=None if error is not None else _get(x, "paused", bool, wi),
                    version=None if error is not None else _get(x, "version", int, wi),
                    message=str(x.get("message") or ""),
                    error=error,
                )
            )
        return cls(_get(doc, "action", str, w), workers, _opt(doc, "version", int, w))


# -- admin listings ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelWorker:
    """A replica of an internal model, as `GET /admin/models` lists it."""

    proxy_id: str
    address: str
    health: str
    inflight_requests: int
    inflight_tokens: int
    sessions: int


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str  # "internal" | "external"
    created: int
    workers: list[ModelWorker]
    base_url: str | None = None  # external models only
    upstream_model: str | None = None

    @classmethod
    def from_json(cls, doc: Any, index: int = 0) -> ModelInfo:
        w = f"models[{index}]"
        workers = [
            ModelWorker(
                proxy_id=_get(x, "proxy_id", str, f"{w}.workers[{i}]"),
                address=_get(x, "address", str, f"{w}.workers[{i}]"),
                health=_get(x, "health", str, f"{w}.workers[{i}]"),
                inflight_requests=_count(x, "inflight_requests", w),
                inflight_tokens=_count(x, "inflight_tokens", w),
                sessions=_count(x, "sessions", w),
            )
            for i, x in enumerate(_items(doc, "workers", w))
        ]
        return cls(
            name=_get(doc, "name", str, w),
            kind=_get(doc, "kind", str, w),
            created=_count(doc, "created", w),
            workers=workers,
            base_url=_opt(doc, "base_url", str, w),
            upstream_model=_opt(doc, "upstream_model", str, w),
        )


@dataclass(frozen=True)
class Worker:
    """A proxy the router knows (`GET /admin/workers`)."""

    proxy_id: str
    address: str
    model: str
    kind: str  # "inference" | "agent" | "unspecified"
    health: str  # "healthy" | "unhealthy" | "draining" | "unknown"
    inflight_requests: int
    inflight_tokens: int
    sessions: int
    last_seen_unix_ms: int
    last_error: str
    labels: dict[str, str]

    @classmethod
    def from_json(cls, doc: Any, index: int = 0) -> Worker:
        w = f"workers[{index}]"
        return cls(
            proxy_id=_get(doc, "proxy_id", str, w),
            address=_get(doc, "address", str, w),
            model=_get(doc, "model", str, w),
            kind=str(doc.get("kind") or "unspecified"),
            health=_get(doc, "health", str, w),
            inflight_requests=_count(doc, "inflight_requests", w),
            inflight_tokens=_count(doc, "inflight_tokens", w),
            sessions=_count(doc, "sessions", w),
            last_seen_unix_ms=_count(doc, "last_seen_unix_ms", w),
            last_error=str(doc.get("last_error") or ""),
            labels=dict(doc.get("labels") or {}),
        )
