"""areal-client: the RL and admin APIs of an areal inference service, for trainers.

    from areal_client import ArealClient

    with ArealClient("http://127.0.0.1:8080", admin_api_key="...") as areal:
        group = areal.start_group(task_id="q-17", group_size=4)
        ...

See the package README for the modules and a trainer's loop.
"""

from __future__ import annotations

from areal_client._version import __version__
from areal_client.async_client import AsyncArealClient
from areal_client.client import ArealClient
from areal_client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    ArealClientError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ExportInterruptedError,
    ExportNotAcknowledgedError,
    InternalServerError,
    InvalidResponseError,
    NotFoundError,
    PartialFailureError,
    PermissionDeniedError,
    RateLimitError,
)
from areal_client.spans import prompt_hash, uncertified_spans
from areal_client.types import (
    ControlResult,
    ExportAck,
    ExportResult,
    ExportSelection,
    ExportSummary,
    FailedSession,
    Group,
    ModelInfo,
    ModelWorker,
    PromptPaths,
    Reward,
    Session,
    SessionStatus,
    ToolCallCounts,
    Trajectory,
    Worker,
    WorkerControl,
)

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "ArealClient",
    "ArealClientError",
    "AsyncArealClient",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "ControlResult",
    "ExportAck",
    "ExportInterruptedError",
    "ExportNotAcknowledgedError",
    "ExportResult",
    "ExportSelection",
    "ExportSummary",
    "FailedSession",
    "Group",
    "InternalServerError",
    "InvalidResponseError",
    "ModelInfo",
    "ModelWorker",
    "NotFoundError",
    "PartialFailureError",
    "PermissionDeniedError",
    "PromptPaths",
    "RateLimitError",
    "Reward",
    "Session",
    "SessionStatus",
    "ToolCallCounts",
    "Trajectory",
    "Worker",
    "WorkerControl",
    "__version__",
    "prompt_hash",
    "uncertified_spans",
]
