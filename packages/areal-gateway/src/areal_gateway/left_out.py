"""What a request asked that areal truly cannot do, left out rather than refused.

A coding-agent harness sends what its first-party API offers (a hosted web search, say);
a 400 for it would stop the harness on its first turn. Where leaving a part out changes
only what areal could never give (the part is left out of the prompt, so the model is not
told of a tool it cannot have), the request goes on, and the omission is said where each
party can see it:

- the client: the `x-areal-left-out` response header, `<api field path>` entries joined
  by ", " (a harness's debug log shows it);
- the operator: one INFO log line per request, and the metric
  `areal_gateway_left_out_total{api, what}` (`what` is the kind, never a request's value).

What would change the recording (a prefill, encrypted reasoning areal did not write) stays
a 400: see each API's request module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

HEADER = b"x-areal-left-out"


@dataclass(slots=True)
class LeftOut:
    """The parts of one request left out: (field path, kind, why)."""

    items: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, path: str, what: str, why: str) -> None:
        self.items.append((path, what, why))

    def __bool__(self) -> bool:
        return bool(self.items)

    def header(self) -> tuple[bytes, bytes] | None:
        if not self.items:
            return None
        return HEADER, ", ".join(p for p, _, _ in self.items).encode("ascii", "replace")

    def report(self, api: str, request_id: str, counter: object | None) -> None:
        """The operator's side: a log line and the metric (`counter`: the gateway's
        `left_out` Counter, labelled api, what)."""
        if not self.items:
            return
        for _, what, _ in self.items:
            if counter is not None:
                counter.labels(api, what).inc()  # type: ignore[attr-defined]
        log.info(
            "request %s (%s): left out %s",
            request_id,
            api,
            "; ".join(f"{p} ({why})" for p, _, why in self.items),
        )
