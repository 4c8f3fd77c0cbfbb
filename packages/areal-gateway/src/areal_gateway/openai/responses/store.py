"""What `previous_response_id` needs, kept in the gateway process: bounded, in memory.

For each stored response (`store` not false) the conversation that continues it: the
conversation it answered (the previous chain and its input, without `instructions`) and its
output items, as input items. Entries are keyed by response id and owned by who made them
(the admin key, or one session key's session): another caller cannot continue, or even learn
of, a response it did not make. Bounded by count (least recently used first out) and by age
(`ttl_s` since last use); a gateway restart forgets them, and each gateway replica has its
own (docs/services.md, "Responses API"). Lists are shared, not copied, between a response
and the ones chained from it (items are never mutated once stored). Also bounded by size: a
count alone is not a memory bound when one conversation may be megabytes; each entry is
charged its conversation's JSON size (an over-count where chained entries share items).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 4096
MAX_BYTES = 256 * 1024 * 1024
TTL_S = 3600.0


@dataclass(slots=True)
class Stored:
    owner: str
    conversation: list[dict[str, Any]]
    used: float
    size: int = 0


class ResponseStore:
    def __init__(
        self, max_entries: int = MAX_ENTRIES, ttl_s: float = TTL_S, max_bytes: int = MAX_BYTES
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.bytes = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, response_id: str, owner: str, conversation: list[dict[str, Any]], size: int = 0
    ) -> None:
        """Keep `conversation` (about `size` bytes of JSON) for `response_id`; one bigger
        than the whole budget is not kept (its chain then ends with a clear 404)."""
        now = time.monotonic()
        self._drop(response_id)
        if size > self.max_bytes:
            return
        self._entries[response_id] = Stored(owner, conversation, now, size)
        self.bytes += size
        self._expire(now)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._pop_oldest()

    def get(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        now = time.monotonic()
        self._expire(now)
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        entry.used = now
        self._entries.move_to_end(response_id)
        return entry.conversation

    def _drop(self, response_id: str) -> None:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            first = next(iter(entries.values()))
            if now - first.used <= self.ttl_s:
                return
            self._pop_oldest()
