"""Check, then commit, then answer: the step between a choice's finished text and the end the
client sees, for chat and completion, whole and streamed.

Every answer is checked first (a finished output that breaks the request's JSON schema is a
502 and nothing of the request is recorded), then each is committed to its session's turn,
and only then does the endpoint send the end of the answer: an acknowledged answer is a
durable one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from areal_proxy.inference.prepared import Answer, Prepared
from areal_proxy.output.structured_json import check
from areal_proxy.recording.recorder import Recorder
from areal_runtime import tracing
from areal_runtime.errors import UpstreamError

log = logging.getLogger(__name__)

# Choice k's answer as its interaction records it: (the prompt messages or text, the
# assistant message or output text).
Recorded = Callable[[int, Answer], tuple[list[dict[str, Any]] | str, dict[str, Any] | str]]


def needed(p: Prepared) -> bool:
    """Whether a streamed request's answers are checked or recorded at all (if not, its
    pipelines need not collect their text)."""
    return p.ot is not None or p.schema is not None


def check_json(p: Prepared, a: Answer) -> None:
    """Refuse to answer with a finished output that breaks the request's JSON schema: the
    engine's grammar let it through (structured_json.py), and a client told "stop" would
    take it for a valid document. A 502, as any upstream answer that breaks its contract;
    nothing is recorded for it. A cut output ("length") is returned as it is, as OpenAI
    returns one."""
    if p.schema is None or a.text_finish != "stop":
        return
    if (why := check(p.schema, a.text)) is not None:
        log.warning("constrained output rejected: %s", why)
        raise UpstreamError(
            f"the engine's constrained decoding made an output that is not valid for "
            f"'response_format': {why}; send the request again",
            code="invalid_structured_output",
        )


class Commit:
    """Settles finished answers on the session's recording (nothing without a session)."""

    def __init__(self, recorder: Recorder | None) -> None:
        self.recorder = recorder

    async def settle(
        self, p: Prepared, answers: list[tuple[int, Answer]], recorded: Recorded
    ) -> None:
        """Check every answer (choice index, answer), then commit each to its turn."""
        if p.schema is not None:
            for _, a in answers:
                check_json(p, a)
        recorder = self.recorder
        if recorder is None or p.ot is None:
            return
        for k, a in answers:
            ot = p.turn_of(k)
            if ot is None:
                continue
            rec = p.recs[k][0]
            messages, response = recorded(k, a)
            session = ot.turn.session
            with tracing.span(
                "proxy.commit",
                session_id=session.session_id,
                group_id=session.group_id,
                interaction_id=ot.interaction_id,
                output_tokens=len(rec.token_ids),
            ):
                await recorder.commit(
                    ot,
                    messages=messages,
                    response=response,
                    rec=rec,
                    finish_reason=a.finish,
                    tool_calls=a.call_counts,
                )
