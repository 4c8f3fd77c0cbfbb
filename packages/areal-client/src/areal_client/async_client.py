"""The RL and admin APIs of an areal inference service as one client class: `AsyncArealClient`
(async_client.py) for asyncio code such as an agent proxy, and `ArealClient` (client.py) for
everything else, generated from async_client.py by scripts/gen_sync_client.py (unasync), so
the two never drift apart. What a call sends and how its answer is read is `_api.py`'s."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import httpx
from httpx import USE_CLIENT_DEFAULT

from areal_client._api import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    EXPORT_ID_HEADER,
    Call,
    Requests,
    admin_key_from,
    admission_pause,
    admission_wait,
    async_sleep,
    decode,
    decode_line,
    transport_error,
)
from areal_client._version import __version__
from areal_client.errors import (
    ArealClientError,
    ExportNotAcknowledgedError,
    InvalidResponseError,
    RateLimitError,
    status_error,
)
from areal_client.types import (
    ControlResult,
    ExportAck,
    ExportResult,
    ExportSelection,
    Group,
    ModelInfo,
    Reward,
    Session,
    SessionStatus,
    Trajectory,
    Worker,
)

T = TypeVar("T")


class AsyncArealClient:
    """A trainer's (or an agent proxy's) handle on an inference service's gateway; the async
    and the sync client have the same methods, results and errors.

    Calls are never retried: starting sessions and setting rewards are not idempotent, and a
    trainer decides itself what a failed step means. Every failure is an `ArealClientError`.
    """

    def __init__(
        self,
        base_url: str,
        admin_api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._api = Requests(base_url, admin_key_from(admin_api_key))
        self.base_url = self._api.base_url
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections),
            headers={"User-Agent": f"areal-client/{__version__}"},
            transport=transport,
        )

    @property
    def http_client(self) -> httpx.AsyncClient:
        """The connection pool, to share with the OpenAI SDK: `session.openai(http_client=...)`
        for the sync client, `session.async_openai(http_client=...)` for the async one.

        Closing an SDK client built on it closes this pool too: close this client instead.
        """
        return self._http

    async def __aenter__(self) -> AsyncArealClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _run(self, call: Call[T]) -> T:
        try:
            r = await self._http.request(
                call.method,
                call.path,
                content=call.content(),
                headers=call.request_headers(),
                timeout=call.timeout if call.timeout is not None else USE_CLIENT_DEFAULT,
            )
        except httpx.RequestError as e:
            raise transport_error(e, call) from e
        return decode(call, r.status_code, r.content, r.headers)

    # -- service ----------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        return await self._run(self._api.health())

    async def served_models(self) -> list[str]:
        """Model ids of `GET /v1/models` (internal and external)."""
        return await self._run(self._api.served_models())

    async def list_models(self) -> list[ModelInfo]:
        """`GET /admin/models`: every model with its workers' health and load."""
        return await self._run(self._api.list_models())

    async def list_workers(self) -> list[Worker]:
        """`GET /admin/workers`: every proxy the router knows."""
        return await self._run(self._api.list_workers())

    # -- sessions, rewards, trajectories ----------------------------------------------

    async def start_group(
        self,
        task_id: str = "",
        group_size: int = 1,
        model: str | None = None,
        *,
        wait_s: float = 0.0,
    ) -> Group:
        """`group_size` sessions for one task, on one proxy (`model` may be omitted when the
        service serves one). Under the model's admission bounds the gateway waits up to
        `wait_s` seconds (0..600) for room, then answers 429 (`RateLimitError`, code
        `capacity_exhausted` or `staleness_bound`, with `retry_after`)."""
        return await self._run(self._api.start_group(task_id, group_size, model, wait_s))

    async def start_group_when_admitted(
        self,
        task_id: str = "",
        group_size: int = 1,
        model: str | None = None,
        *,
        max_wait_s: float = 600.0,
    ) -> Group:
        """Start a group as soon as the model's admission bounds admit it, waiting up to
        `max_wait_s` seconds in all: the gateway holds the start until there is room (its
        `wait_s`), and a 429 that still comes back is retried after its Retry-After. Past
        `max_wait_s`, the last `RateLimitError` is raised."""
        deadline = time.monotonic() + max_wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                return await self.start_group(
                    task_id, group_size, model, wait_s=admission_wait(left)
                )
            except RateLimitError as err:
                pause = admission_pause(err, deadline - time.monotonic())
                if pause is None:
                    raise
                await async_sleep(pause)

    async def start_session(
        self, task_id: str = "", model: str | None = None, *, wait_s: float = 0.0
    ) -> Session:
        """One session (a group of one); `wait_s` as in `start_group`."""
        return (await self.start_group(task_id, 1, model, wait_s=wait_s)).sessions[0]

    async def start_session_when_admitted(
        self, task_id: str = "", model: str | None = None, *, max_wait_s: float = 600.0
    ) -> Session:
        """One session, as soon as admission admits it (`start_group_when_admitted`)."""
        group = await self.start_group_when_admitted(task_id, 1, model, max_wait_s=max_wait_s)
        return group.sessions[0]

    async def set_reward(
        self, session: Session | str, reward: float, *, interaction_id: str | None = None
    ) -> Reward:
        """Reward a session's last interaction (or `interaction_id`). A `Session` acts with its
        own key; a session id acts with the admin key."""
        return await self._run(self._api.set_reward(session, reward, interaction_id))

    async def end_session(self, session: Session | str, *, failure: str | None = None) -> int:
        """End a session (its records stay exportable); returns how many were ended.
        `failure`: it failed, and why (a short code: "engine_refusal", "timeout",
        "client_error", ...); exports name it, and their group policies count it as failed.
        Also for a session already ended (once)."""
        return await self._run(self._api.end_session(session, failure))

    async def session_status(self, session: Session | str) -> SessionStatus:
        """A session's status: its interactions, and how their chat prompts were built
        (`prompt`: continued from the previous turn's, or whole, and why). A `Session` reads
        with its own key; a session id with the admin key. An ended session stays readable."""
        return await self._run(self._api.session_status(session))

    async def export(
        self,
        *,
        group_id: str | None = None,
        session_ids: list[str] | None = None,
        session: Session | None = None,
        style: str = "concat",
        side_calls: str = "include",
        discount: float = 1.0,
        remove_session: bool = False,
        acknowledge: bool = True,
        selection: ExportSelection | None = None,
    ) -> ExportResult:
        """Trajectory rows of a group, of sessions (admin key), or of one `session` (its key).

        `style`: "concat" (one row per chain of turns) or "individual" (one per interaction);
        `side_calls`: "include" (every row, side calls marked `side`), "exclude" or "only".

        With `remove_session` the sessions are removed once this call has every row: it
        acknowledges the export itself. `acknowledge=False` leaves that to the caller, who
        passes the rows on first: the result's `export_id` goes to `ack_export` once they are
        safe (until then nothing is removed, and another export returns the same rows).

        Every row carries `staleness`, `min_version`, `max_version`; `selection` bounds
        staleness and sets group policies (`ExportSelection`); what it held back is in
        `result.summary`."""
        if not isinstance(acknowledge, bool):
            raise ValueError(f"acknowledge must be a boolean, got {acknowledge!r}")
        call = self._api.export(
            group_id=group_id,
            session_ids=session_ids,
            session=session,
            style=style,
            side_calls=side_calls,
            discount=discount,
            remove_session=remove_session,
            selection=selection,
        )
        result = await self._run(call)
        if remove_session:
            export_id = self._exported_id(result.export_id)
            if acknowledge:
                # The whole answer is read and parsed: only now may the sessions go.
                await self._ack(export_id, call.key, result)
        return result

    async def ack_export(self, export_id: str, *, session: Session | None = None) -> ExportAck:
        """Remove what an export with `remove_session` read (`export` and `iter_export` do
        this themselves once they have every row). `session`: the one whose key exported."""
        return await self._run(
            self._api.ack_export(export_id, session.api_key if session else None)
        )

    async def _ack(self, export_id: str, key: str | None, result: ExportResult | None) -> None:
        try:
            await self._run(self._api.ack_export(export_id, key))
        except ArealClientError as e:
            raise ExportNotAcknowledgedError(str(e), export_id=export_id, result=result) from e

    @staticmethod
    def _exported_id(export_id: str | None) -> str:
        if not export_id:
            raise InvalidResponseError(
                "export with remove_session: the gateway named no export_id to acknowledge "
                "(an older gateway?); nothing was removed"
            )
        return export_id

    def iter_export(
        self,
        *,
        group_id: str | None = None,
        session_ids: list[str] | None = None,
        session: Session | None = None,
        style: str = "concat",
        side_calls: str = "include",
        discount: float = 1.0,
        remove_session: bool = False,
        selection: ExportSelection | None = None,
    ) -> AsyncIterator[Trajectory]:
        """The same rows streamed as JSON lines, one at a time (for exports too large to hold).

        Arguments are checked here, before the first row is asked for. With `remove_session`
        the sessions are removed (acknowledged) only after the last row was read: a loop that
        stops early, or a stream that breaks, removes nothing, and a new export has every row.
        `selection` as in `export` (JSON lines carry no summary).
        """
        call = self._api.export(
            group_id=group_id,
            session_ids=session_ids,
            session=session,
            style=style,
            side_calls=side_calls,
            discount=discount,
            remove_session=remove_session,
            lines=True,
            selection=selection,
        )
        return self._rows(call, remove_session)

    async def _rows(self, call: Call[Any], remove: bool) -> AsyncIterator[Trajectory]:
        try:
            async with self._http.stream(
                call.method, call.path, content=call.content(), headers=call.request_headers()
            ) as r:
                if r.status_code >= 400:
                    raise status_error(
                        r.status_code, await r.aread(), method=call.method, path=call.path
                    )
                export_id = r.headers.get(EXPORT_ID_HEADER)
                index = 0
                async for line in r.aiter_lines():
                    row = decode_line(line, index)
                    if row is not None:
                        index += 1
                        yield row
        except httpx.RequestError as e:
            raise transport_error(e, call) from e
        if remove:
            # Here only when the caller took every row and the body ended whole (httpx
            # raises on a cut chunked body; an error line raised above): the sessions may go.
            await self._ack(self._exported_id(export_id), call.key, None)

    # -- generation control -------------------------------------------------------------

    async def pause(self, *, model: str | None = None, worker: str | None = None) -> ControlResult:
        """Pause generation (in-flight requests are aborted at the engine, resumed later)."""
        return await self._run(self._api.control("pause", {}, model, worker))

    async def resume(self, *, model: str | None = None, worker: str | None = None) -> ControlResult:
        """`/admin/continue`: paused requests are resubmitted where they stopped."""
        return await self._run(self._api.control("continue", {}, model, worker))

    async def set_version(
        self, version: int, *, model: str | None = None, worker: str | None = None
    ) -> ControlResult:
        return await self._run(self._api.set_version(version, model, worker))

    async def update_weights(
        self,
        path: str,
        *,
        version: int | None = None,
        model: str | None = None,
        worker: str | None = None,
    ) -> ControlResult:
        """Pause, load the checkpoint at `path` on each engine, version + 1 (or `version`),
        continue. `.version` of the result is the new weight version."""
        return await self._run(self._api.update_weights(path, version, model, worker))
