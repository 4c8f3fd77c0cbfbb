"""Stored responses: what `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` need.

For each stored response (`store` not false, status completed or incomplete) one entry: the
response object as the POST answered it, the id of the response it continued (its parent),
and its OWN new conversation items: the request's input items (without `instructions`) and
its output as input items. The conversation a `previous_response_id` continues is rebuilt
on read by walking the parents to the root and joining their items. An entry never holds
its chain's earlier turns: an agent session of n turns would then store O(n^2) items (each
turn's entry a copy of the whole conversation so far); walking the chain keeps it O(n), and
a read is the same order as the chat body it becomes.

Entries are owned by who made them (the admin key, or one session key's session): another
caller cannot read, continue, delete, or even learn of a response it did not make. Bounded
by count, by bytes (each entry charged its own items and response JSON) and by age (`ttl_s`
since the last use; continuing a response uses its whole chain). Eviction is least recently
used first, and within a chain used together the newest turn goes first, so what is left of
a chain can still be continued. A response whose chain lost an earlier turn (deleted,
evicted) can still be read but no longer continued (404 `previous_response_not_found`).

Two backends with one interface (async: the shared one does file I/O off the event loop):
`MemoryStore`, this process's own (the default; a restart forgets it), and `SqliteStore`
(`--response-store PATH`, sqlite_store.py), one file every gateway process of a service
shares, so a chain may continue on any of them and survives a gateway's restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

MAX_ENTRIES = 4096
MAX_BYTES = 256 * 1024 * 1024
TTL_S = 3600.0

Items = list[dict[str, Any]]


@dataclass(slots=True)
class Entry:
    """One response to keep: its id and owner, the response it continued, its own items
    (input then output) and the response object's JSON."""

    response_id: str
    owner: str
    parent: str | None
    inputs: Items
    outputs: Items
    response: bytes
    size: int = 0


class ResponseStore(Protocol):
    async def put(self, entry: Entry) -> None:
        """Keep `entry` (replacing one of the same id) and mark its chain used; one bigger
        than the whole byte budget is not kept (continuing it is then a clear 404)."""

    async def conversation(self, response_id: str, owner: str) -> Items | None:
        """The conversation that continues `response_id` (its chain's items, oldest first),
        or None: unknown, expired, someone else's, or a turn of its chain is gone."""

    async def response(self, response_id: str, owner: str) -> bytes | None:
        """The stored response object's JSON, or None."""

    async def delete(self, response_id: str, owner: str) -> bool:
        """Forget `response_id`; False if there was none (or not the owner's)."""

    async def aclose(self) -> None: ...


def entry_size(inputs: bytes, outputs: bytes, response: bytes) -> int:
    return len(inputs) + len(outputs) + len(response)


@dataclass(slots=True)
class _Kept:
    entry: Entry
    used: float


class MemoryStore:
    """This process's own store (see the module docstring)."""

    def __init__(
        self, max_entries: int = MAX_ENTRIES, ttl_s: float = TTL_S, max_bytes: int = MAX_BYTES
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.bytes = 0
        # Least recently used first.
        self._entries: OrderedDict[str, _Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, entry: Entry) -> None:
        now = time.monotonic()
        self._drop(entry.response_id)
        self._expire(now)
        if entry.size > self.max_bytes:
            return
        self._entries[entry.response_id] = _Kept(entry, now)
        self.bytes += entry.size
        self._touch(self._chain(entry.response_id, entry.owner, now) or [], now)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.entry.size

    async def conversation(self, response_id: str, owner: str) -> Items | None:
        now = time.monotonic()
        self._expire(now)
        chain = self._chain(response_id, owner, now)
        if chain is None or chain[-1].entry.parent is not None:
            return None
        self._touch(chain, now)
        items: Items = []
        for kept in reversed(chain):
            items += kept.entry.inputs
            items += kept.entry.outputs
        return items

    async def response(self, response_id: str, owner: str) -> bytes | None:
        now = time.monotonic()
        self._expire(now)
        kept = self._entries.get(response_id)
        if kept is None or kept.entry.owner != owner:
            return None
        return kept.entry.response

    async def delete(self, response_id: str, owner: str) -> bool:
        kept = self._entries.get(response_id)
        if kept is None or kept.entry.owner != owner:
            return False
        self._drop(response_id)
        return True

    async def aclose(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _chain(self, response_id: str, owner: str, now: float) -> list[_Kept] | None:
        """`response_id` and its ancestors that are still here (newest first); None if
        `response_id` itself is not the owner's."""
        chain: list[_Kept] = []
        rid: str | None = response_id
        while rid is not None and len(chain) <= len(self._entries):
            kept = self._entries.get(rid)
            if kept is None or kept.entry.owner != owner:
                break
            chain.append(kept)
            rid = kept.entry.parent
        return chain or None

    def _touch(self, chain: list[_Kept], now: float) -> None:
        # Newest turn first, so the root ends most recently used: eviction takes a chain's
        # newest turns before the ones they need.
        for kept in chain:
            kept.used = now
            self._entries.move_to_end(kept.entry.response_id)

    def _drop(self, response_id: str) -> None:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.bytes -= old.entry.size

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            first = next(iter(entries.values()))
            if now - first.used <= self.ttl_s:
                return
            entries.popitem(last=False)
            self.bytes -= first.entry.size


def open_store(path: str = "") -> ResponseStore:
    """The shared SQLite store at `path`, or this process's own when `path` is empty."""
    if not path:
        return MemoryStore()
    from areal_gateway.openai.responses.sqlite_store import SqliteStore

    return SqliteStore(path)
