"""The RL session RPCs: sessions started and ended, rewards, a session's status, the export of
trajectories and its acknowledgement (claims). Every action reads or writes SQLite, on the
recording thread (recording/sessions.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proxy.common.records import Session
from areal_proxy.recording import export
from areal_proxy.recording.claims import ExportClaims
from areal_proxy.recording.selection import Policy, Summary
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.serving.rpc_base import ServicerBase
from areal_runtime.errors import (
    Conflict,
    InvalidRequest,
    PermissionDenied,
    Unauthenticated,
    abort,
)
from areal_runtime.session_keys import key_matches

# Rows per ExportChunk: a large export streams as many JSONL chunks.
_CHUNK_ROWS = 256
# ... and about this many bytes at most (+ one row): 256 rows of a long session's turns
# (25 k tokens each) made a 50 MB chunk, over gRPC's message limit (the export failed 429).
_CHUNK_BYTES = 2 * 1024 * 1024


class SessionRpcs(ServicerBase, proxy_pb2_grpc.InferenceProxyServiceServicer):
    # The exports whose sessions wait for AckExport (None: no book; set by ProxyServicer).
    claims: ExportClaims | None

    def _sessions(self) -> SessionBook:
        if self.book is None:
            raise Conflict("this proxy records no sessions", code="no_recording")
        return self.book

    def _acting_on(
        self, env: Any, session_id: str, *, for_turn: bool, ended_ok: bool = False
    ) -> Session:
        """The session `env`'s key may act on: its own (session key) or any (admin key).
        `ended_ok`: an ended session too (a read); otherwise an ended one is a 409."""
        book = self._sessions()
        if env is not None and env.is_admin:
            found = book.store.session(session_id)
            if found is None:
                raise book.missing(session_id)
            return found
        key = env.api_key if env is not None else ""
        if not key or (env.session_id and env.session_id != session_id):
            raise PermissionDenied(
                "a session key may act only on its own session", code="forbidden_session"
            )
        if ended_ok:
            # SessionBook.authorize without its refusal of an ended session: the same 404
            # and 401.
            found = book.store.session(session_id)
            if found is None:
                raise book.missing(session_id)
            if not key_matches(key, found.key_hash):
                raise Unauthenticated("invalid session key", code="invalid_session_key")
            return found
        return book.authorize(session_id, key, for_turn=for_turn)

    async def _rpc(self, rpc: str, context: Any, action: Callable[[], Any]) -> Any:
        try:
            # Every session action reads or writes SQLite: on the recording thread.
            result = await self._sessions().call(action)
        except Exception as e:
            err = self._error(e)
            self._count(rpc, str(err.http_status))
            await abort(context, err)
            raise AssertionError("unreachable") from e
        self._count(rpc, "200")
        return result

    async def StartSessions(self, request: Any, context: Any) -> proxy_pb2.StartSessionsResponse:
        def act() -> proxy_pb2.StartSessionsResponse:
            if not request.group_id or not request.sessions:
                raise InvalidRequest("group_id and sessions are required", param="sessions")
            creds = [(c.session_id, c.session_api_key) for c in request.sessions]
            self._sessions().start(
                request.group_id, request.task_id, request.model or self.state.model, creds
            )
            return proxy_pb2.StartSessionsResponse(
                group_id=request.group_id, sessions=request.sessions
            )

        return await self._rpc("StartSessions", context, act)

    async def EndSessions(self, request: Any, context: Any) -> proxy_pb2.EndSessionsResponse:
        def act() -> proxy_pb2.EndSessionsResponse:
            env = request.envelope if request.HasField("envelope") else None
            for sid in request.session_ids:
                self._acting_on(env, sid, for_turn=False)
            return proxy_pb2.EndSessionsResponse(
                ended=self._sessions().end(list(request.session_ids), request.failure)
            )

        return await self._rpc("EndSessions", context, act)

    async def SetReward(self, request: Any, context: Any) -> proxy_pb2.SetRewardResponse:
        def act() -> proxy_pb2.SetRewardResponse:
            env = request.envelope if request.HasField("envelope") else None
            # Not for_turn: set_reward itself says what a closed session still accepts.
            session = self._acting_on(env, request.session_id, for_turn=False)
            iid = self._sessions().set_reward(session, request.interaction_id, request.reward)
            return proxy_pb2.SetRewardResponse(interaction_id=iid, reward=request.reward)

        return await self._rpc("SetReward", context, act)

    async def GetSession(self, request: Any, context: Any) -> proxy_pb2.GetSessionResponse:
        def act() -> proxy_pb2.GetSessionResponse:
            if not request.session_id:
                raise InvalidRequest("session_id is required", param="session_id")
            env = request.envelope if request.HasField("envelope") else None
            # A read: an ended session keeps its status (a trainer looks after it ended).
            session = self._acting_on(env, request.session_id, for_turn=False, ended_ok=True)
            status = self._sessions().status(session)
            return proxy_pb2.GetSessionResponse(status=orjson.dumps(status))

        return await self._rpc("GetSession", context, act)

    async def ExportTrajectories(self, request: Any, context: Any) -> None:  # type: ignore[override]
        try:
            book = self._sessions()
            env = request.envelope if request.HasField("envelope") else None

            summary = Summary(self.controller.version)
            policy = Policy(
                max_staleness=(
                    request.max_staleness if request.HasField("max_staleness") else None
                ),
                stale=request.stale or "drop",
                mask_stale_tokens=request.mask_stale_tokens,
                drop_incomplete_group=request.drop_incomplete_group,
                min_usable_group_size=request.min_usable_group_size,
            )

            def prepare() -> tuple[list[Session], Iterator[dict[str, Any]]]:
                if request.remove_session and not request.export_id:
                    raise InvalidRequest(
                        "remove_session needs an export_id: sessions are removed by "
                        "AckExport(export_id) once the client has the rows",
                        param="export_id",
                    )
                sessions = book.resolve_export(list(request.session_ids), request.group_id)
                if env is None or not env.is_admin:
                    for s in sessions:
                        self._acting_on(env, s.session_id, for_turn=False)
                # proto3 cannot tell 0.0 from unset: the gateway always sends the discount.
                style = request.style or export.DEFAULT_STYLE
                side_calls = request.side_calls or "include"
                rows = book.export_rows(
                    sessions,
                    style,
                    request.discount,
                    side_calls,
                    version=summary.version,
                    policy=policy,
                    summary=summary,
                )
                return sessions, rows

            def next_chunk(rows: Iterator[dict[str, Any]]) -> list[bytes]:
                out: list[bytes] = []
                size = 0
                for r in itertools.islice(rows, _CHUNK_ROWS):
                    out.append(orjson.dumps(r) + b"\n")
                    size += len(out[-1])
                    if size >= _CHUNK_BYTES:
                        break
                return out

            # Reading the rows, building and serializing them: on the recording thread, one
            # chunk at a time (other recording work runs between chunks), never on the loop.
            sessions, rows = await book.call(prepare)
            while batch := await book.call(next_chunk, rows):
                await context.write(proxy_pb2.ExportChunk(jsonl=b"".join(batch), rows=len(batch)))
            # Every row is read: the summary is whole. Last, in a chunk of its own.
            await context.write(proxy_pb2.ExportChunk(summary=orjson.dumps(summary.to_json())))
            self.metrics.observe_export(
                summary.staleness,
                summary.outcomes(),
                summary.dropped_groups,
                summary.masked_tokens,
            )
            # Removal only when asked, and never here: the rows are only handed to gRPC, and
            # the client may still not get them (another proxy of the export fails, the
            # gateway or the client goes away). The sessions are claimed under the export's
            # id; AckExport, sent once the client has everything, removes them
            # (recording/claims.py). Either way the retention of these sessions starts
            # (--retention-seconds once ended too).
            if request.remove_session:
                assert self.claims is not None
                await book.call(self.claims.claim, request.export_id, sessions)
            await book.call(book.exported, sessions)
        except Exception as e:
            err = self._error(e)
            self._count("ExportTrajectories", str(err.http_status))
            await abort(context, err)
            return
        self._count("ExportTrajectories", "200")

    async def AckExport(self, request: Any, context: Any) -> proxy_pb2.AckExportResponse:
        def act() -> proxy_pb2.AckExportResponse:
            if not request.export_id:
                raise InvalidRequest("export_id is required", param="export_id")
            claims = self.claims
            assert claims is not None  # _rpc refused a proxy without a book already
            env = request.envelope if request.HasField("envelope") else None
            if env is not None and env.is_admin:
                out = claims.ack(request.export_id)
            else:
                # A session key removes only its own session, and only with its key.
                sid = env.session_id if env is not None else ""
                key = env.api_key if env is not None else ""
                if not sid or not key:
                    raise PermissionDenied(
                        "a session key may acknowledge only its own session's export",
                        code="forbidden_session",
                    )
                out = claims.ack(request.export_id, session_id=sid, api_key=key)
            return proxy_pb2.AckExportResponse(
                removed_session_ids=out.removed,
                kept_session_ids=out.kept,
                emptied_group_ids=out.emptied_groups,
            )

        return await self._rpc("AckExport", context, act)
