"""Records the requests made with a session key on that session (RL recording).

Requests with the admin key record nothing: the admin key is an operator's
tool for plain inference and never a session (packages/areal-proxy/README.md,
"Decisions"). A session key's request is authorized against the session
(its key hash), gets its parent turn (longest conversation prefix), and is
committed to SQLite before the answer is acknowledged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from areal_proto.common.v1.envelope_pb2 import Envelope
from areal_proxy.common.records import Interaction
from areal_proxy.generation.controller import GenerationRecord
from areal_proxy.prompt.incremental import Built, SessionPrompts
from areal_proxy.recording.chains import CALL_KINDS
from areal_proxy.recording.sessions import SessionBook, Turn
from areal_proxy.recording.store import continues, sharing
from areal_runtime.errors import InvalidRequest

# A request body up to this size starts its session's turn on the event loop when it can
# (`Recorder.begin`): hashing its new messages costs microseconds, the hop to the recording
# thread and back about 0.1 ms of CPU.
INLINE_BODY_BYTES = 64 * 1024
# ... and commits it there when its prompt and output hold at most this many ids (copying and
# packing them is about 1 us per thousand; comparing the prompt with its parent's, a few).
INLINE_TOKENS = 16 * 1024


@dataclass(slots=True)
class OpenTurn:
    turn: Turn
    interaction_id: str
    started: float
    # Tokens the prompt took over from the parent turn (concat template), else 0.
    inherited: int = 0
    # A request with several choices (`n`, a list of prompts): each is an interaction of its
    # own, all with the request's response id and their choice index.
    response_id: str = ""
    choice_index: int = 0
    # The chat prompt as built for this turn, and the request body's size.
    prompt: Built | None = None
    body_bytes: int = 0
    # What the request said it is (Envelope.call_kind: "side", "main" or ""), and how many
    # tools it declared.
    call_kind: str = ""
    tools_declared: int = 0


class Recorder:
    def __init__(self, book: SessionBook, prompts: SessionPrompts | None = None) -> None:
        self.book = book
        # Turns the prompt state of an answered chat turn into what its next turn continues.
        self.prompts = prompts

    async def begin(
        self,
        env: Envelope | None,
        messages: list[dict[str, Any]] | None,
        interaction_id: str,
        body_bytes: int | None = None,
    ) -> OpenTurn | None:
        """The open turn of a session request, or None for a request to record nothing.

        On the recording thread: the key check and the parent lookup read SQLite, and the
        lineage hashes every message (tens of ms for a body of megabytes). A small request
        (`body_bytes`) of a session whose state is in memory starts here instead, when the
        thread is idle (SessionBook.begin_known)."""
        if env is None or not env.session_id:
            return None
        kind = env.call_kind
        if kind and kind not in CALL_KINDS:
            raise InvalidRequest(
                f"x-areal-call must be one of {', '.join(CALL_KINDS)} (or absent), got "
                f"{kind[:40]!r}",
                param="x-areal-call",
            )
        started = time.time()
        ot = None
        if body_bytes is not None and body_bytes <= INLINE_BODY_BYTES:
            turn = self.book.try_now(self.book.begin_known, env.session_id, env.api_key, messages)
            if turn is not None:
                ot = OpenTurn(turn, interaction_id, started)
        if ot is None:
            ot = await self.book.call(self._begin, env, messages, interaction_id, started)
        ot.call_kind = kind
        return ot

    def _begin(
        self,
        env: Envelope,
        messages: list[dict[str, Any]] | None,
        interaction_id: str,
        started: float,
    ) -> OpenTurn:
        session = self.book.authorize(env.session_id, env.api_key, for_turn=True)
        return OpenTurn(self.book.begin_turn(session, messages), interaction_id, started)

    async def commit(
        self,
        ot: OpenTurn,
        *,
        messages: list[dict[str, Any]] | str,
        response: dict[str, Any] | str,
        rec: GenerationRecord,
        finish_reason: str,
        tool_calls: tuple[int, int] = (0, 0),
    ) -> Interaction:
        """`tool_calls`: (tool calls the output made, calls the parser read)."""
        now = time.time()
        if (
            ot.body_bytes <= INLINE_BODY_BYTES
            and (not isinstance(messages, str) or len(messages) <= INLINE_BODY_BYTES)
            and len(rec.prompt_ids) + len(rec.token_ids) <= INLINE_TOKENS
        ):
            # A small turn: committed here when the recording thread is idle
            # (SessionBook.try_write_now), before the answer goes out as on the thread.
            it = self.book.try_write_now(
                ot.turn.session.session_id,
                self._commit,
                ot,
                messages,
                response,
                rec,
                finish_reason,
                now,
                tool_calls,
            )
            if it is not None:
                return it
        # Copying the token lists, packing and inserting them: on the recording thread.
        return await self.book.call(
            self._commit, ot, messages, response, rec, finish_reason, now, tool_calls
        )

    def _commit(
        self,
        ot: OpenTurn,
        messages: list[dict[str, Any]] | str,
        response: dict[str, Any] | str,
        rec: GenerationRecord,
        finish_reason: str,
        now: float,
        tool_calls: tuple[int, int] = (0, 0),
    ) -> Interaction:
        timings = {"total_s": now - ot.started}
        if rec.first_token_at is not None:
            timings["ttft_s"] = rec.first_token_at - rec.created
        parent = ot.turn.parent
        built = ot.prompt
        # Leading prompt ids known to be the parent's prompt + answer: compared no further.
        known = built.reused if built is not None else 0
        inherited = 0
        if parent is not None and continues(rec.prompt_ids, parent, known):
            inherited = len(parent.prompt_ids) + len(parent.output_ids)
        it = Interaction(
            interaction_id=ot.interaction_id,
            session_id=ot.turn.session.session_id,
            seq=0,
            messages=messages,
            response=response,
            # The prompt's list itself: nothing changes it once generation started, and the
            # next turn's prompt state shares it.
            prompt_ids=rec.prompt_ids,
            output_ids=list(rec.token_ids),
            logprobs=list(rec.logprobs),
            versions=list(rec.versions),
            finish_reason=finish_reason,
            parent_id=parent.interaction_id if parent is not None else None,
            created_at=ot.started,
            finished_at=now,
            timings=timings,
            inherited=inherited,
            response_id=ot.response_id or ot.interaction_id,
            choice_index=ot.choice_index,
            prompt_path=built.path if built is not None else "",
            # "" in the record is this proxy's own engine: named, so a row says which proxy
            # made each token however many replicas a migrated request went through.
            replicas=[(i, r or self.book.proxy_id) for i, r in rec.replicas],
            call_kind=ot.call_kind,
            tools_declared=ot.tools_declared,
            tool_calls_made=tool_calls[0],
            tool_calls_parsed=tool_calls[1],
        )
        # What the store may take from the parent rather than write again (flat disk per turn).
        it.shared_tokens, it.shared_messages = sharing(it, parent, ot.turn.covered, known)
        state = None
        if built is not None and self.prompts is not None:
            state = self.prompts.after_answer(built.state, it.output_ids)
        return self.book.record_now(
            it, messages_hash=ot.turn.messages_hash, state=state, body_bytes=ot.body_bytes
        )
