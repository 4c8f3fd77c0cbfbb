"""Admission control per model: how many sessions may start, under AReaL's rule.

A model's bounds (all optional; none set = no admission control, every start admitted):

- `max_concurrent_rollouts` C: running + n <= C
- `max_staleness` η with `batch_size` B: running + ended + consumed + n <= (η + v + 1) * B,
  v being the model's current weight version

where n is the number of samples the start asks for (a group of n sessions: n; one
session: 1), and every admitted session is in exactly one of three states until it is gone:

- running: admitted, not yet ended;
- ended: `end_session` was called for it, but it is not yet exported and acknowledged: it
  no longer generates, so it leaves the concurrency bound, but its sample is still on its
  way to the trainer, so it keeps its place in the staleness bound (AReaL counts a finished
  rollout the same way until the trainer takes it);
- consumed: exported with removal and acknowledged (`ack_export`): a counter, no longer a
  session. Consumed samples are what the trainer has taken; (η + v + 1) * B is how many
  samples versions up to v + η may take, so a sample started now is at most η versions
  stale when the trainer reaches it.

A session released any other way (its start failed, its pin expired, its proxy or model
was removed) is dropped: it frees its place and counts nowhere.

The ledger follows the router's session pins: it changes only where a pin is made (a
BindSession with admission) or released, on the router's event loop, so the check and the
reservation are one step that no concurrent start can interleave with, and several gateways
share one count. It is persisted with the pins (StateStore), so it survives a router
restart; a proxy restart changes nothing here (its sessions stay pinned).

Everything here runs on the server's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import AdmissionRefused, InvalidRequest

# A refused start may retry after this long (Retry-After) when nothing tells us better:
# sessions end and weights change on the scale of seconds.
RETRY_AFTER_S = 1
# The longest a start may wait for room (BindAdmission.wait_s; the HTTP API says 0..600).
MAX_WAIT_S = 600.0

_FIELDS = ("max_staleness", "batch_size", "max_concurrent_rollouts")


def _has(s: router_pb2.AdmissionSettings, name: str) -> bool:
    return s.HasField(name)  # type: ignore[arg-type]  # one of _FIELDS


@dataclass
class Bounds:
    max_staleness: int | None = None
    batch_size: int | None = None
    max_concurrent_rollouts: int | None = None

    @property
    def active(self) -> bool:
        return self.max_concurrent_rollouts is not None or self.max_staleness is not None

    def check(self) -> None:
        """The bounds make sense together; else a 400 naming the field."""
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidRequest(
                "max_staleness must be >= 0 (weight versions).", param="max_staleness"
            )
        for name in ("batch_size", "max_concurrent_rollouts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequest(f"{name} must be >= 1.", param=name)
        if (self.max_staleness is None) != (self.batch_size is None):
            missing = "batch_size" if self.batch_size is None else "max_staleness"
            raise InvalidRequest(
                "The staleness bound needs both max_staleness and batch_size; "
                f"set {missing} too (or unset both).",
                param=missing,
            )

    def to_proto(self) -> router_pb2.AdmissionSettings:
        out = router_pb2.AdmissionSettings()
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(out, name, value)
        return out

    @classmethod
    def from_proto(cls, s: router_pb2.AdmissionSettings) -> Bounds:
        return cls(**{name: getattr(s, name) if _has(s, name) else None for name in _FIELDS})

    def merged(self, s: router_pb2.AdmissionSettings) -> Bounds:
        """These bounds with the fields present in `s` replaced."""
        return Bounds(
            **{name: getattr(s, name) if _has(s, name) else getattr(self, name) for name in _FIELDS}
        )

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}


@dataclass
class ModelAdmission:
    bounds: Bounds = field(default_factory=Bounds)
    version: int = 0
    consumed: int = 0
    running: set[str] = field(default_factory=set)
    ended: set[str] = field(default_factory=set)
    # Since this router started (not persisted).
    admitted_total: int = 0
    refused_total: int = 0
    waiting: int = 0
    # Set (and replaced) whenever room may have appeared: waiters re-check then.
    changed: asyncio.Event | None = None

    def room(self) -> tuple[int | None, str]:
        """Sessions one more start may add now, and the bound that says so (None, "": no
        bound). Never below 0."""
        left: int | None = None
        which = ""
        b = self.bounds
        if b.max_concurrent_rollouts is not None:
            left = b.max_concurrent_rollouts - len(self.running)
            which = "capacity"
        if b.max_staleness is not None and b.batch_size is not None:
            used = len(self.running) + len(self.ended) + self.consumed
            stale = (b.max_staleness + self.version + 1) * b.batch_size - used
            if left is None or stale < left:
                left, which = stale, "staleness"
        return (None if left is None else max(0, left)), which

    def to_json(self) -> dict[str, Any]:
        return {"bounds": self.bounds.to_json(), "version": self.version, "consumed": self.consumed}

    def wake(self) -> None:
        if self.changed is not None:
            self.changed.set()
            self.changed = None


class Admission:
    """Every model's bounds and counts; the sessions admitted, by id."""

    def __init__(self) -> None:
        self.models: dict[str, ModelAdmission] = {}
        # Admitted session -> its model.
        self.sessions: dict[str, str] = {}
        self.dirty_models: set[str] = set()
        self.dirty_sessions: set[str] = set()

    @property
    def dirty(self) -> bool:
        return bool(self.dirty_models or self.dirty_sessions)

    def model(self, name: str) -> ModelAdmission:
        m = self.models.get(name)
        if m is None:
            m = self.models[name] = ModelAdmission()
        return m

    # -- settings and version -------------------------------------------

    def configure(
        self,
        name: str,
        settings: router_pb2.AdmissionSettings,
        *,
        replace: bool = False,
        reset_consumed: bool = False,
    ) -> ModelAdmission:
        m = self.model(name)
        bounds = Bounds.from_proto(settings) if replace else m.bounds.merged(settings)
        bounds.check()
        m.bounds = bounds
        if reset_consumed:
            m.consumed = 0
        self.dirty_models.add(name)
        m.wake()
        return m

    def observe_version(self, name: str, version: int) -> None:
        """A poll: a proxy of `name` stamps weight version `version`. Polls only raise the
        rule's version: a lagging or restarted replica (a restarted proxy starts at 0) does
        not take back room already given."""
        m = self.models.get(name)
        if m is None:
            if version <= 0:
                return
            m = self.model(name)
        if version > m.version:
            self._set_version(name, m, version)

    def set_version(self, name: str, version: int) -> None:
        """The gateway set `version` on every proxy of `name` (set_version, update_weights):
        the rule uses it at once, lower too (a trainer that starts over). A poll answered
        just before may raise it back once; the next set_version settles it."""
        self._set_version(name, self.model(name), version)

    def _set_version(self, name: str, m: ModelAdmission, version: int) -> None:
        if version != m.version:
            grew = version > m.version
            m.version = version
            self.dirty_models.add(name)
            if grew:
                m.wake()

    def forget_model(self, name: str) -> None:
        m = self.models.pop(name, None)
        if m is None:
            return
        for sid in (*m.running, *m.ended):
            self.sessions.pop(sid, None)
            self.dirty_sessions.add(sid)
        self.dirty_models.add(name)
        m.wake()

    # -- the rule ---------------------------------------------------------

    def _refusal(self, name: str, m: ModelAdmission, n: int, which: str) -> AdmissionRefused:
        b = m.bounds
        if which == "capacity":
            return AdmissionRefused(
                f"Model {name!r} is at max_concurrent_rollouts={b.max_concurrent_rollouts} "
                f"({len(m.running)} running; this start asks for {n}). Retry after the "
                "Retry-After delay, pass wait_s to wait for room, or end sessions.",
                code="capacity_exhausted",
                retry_after_s=RETRY_AFTER_S,
            )
        limit = ((b.max_staleness or 0) + m.version + 1) * (b.batch_size or 0)
        return AdmissionRefused(
            f"Model {name!r} is at its staleness bound: running {len(m.running)} + ended "
            f"{len(m.ended)} + consumed {m.consumed} + {n} would exceed (max_staleness "
            f"{b.max_staleness} + version {m.version} + 1) x batch_size {b.batch_size} = "
            f"{limit}. Export and acknowledge (ack_export) finished sessions or update the "
            "weights, then retry after the Retry-After delay (or pass wait_s).",
            code="staleness_bound",
            retry_after_s=RETRY_AFTER_S,
        )

    def try_admit(self, name: str, n: int) -> AdmissionRefused | None:
        """None if `n` more sessions fit now, else the refusal. Reserves nothing."""
        m = self.models.get(name)
        if m is None or not m.bounds.active:
            return None
        left, which = m.room()
        if left is None or n <= left:
            return None
        return self._refusal(name, m, n, which)

    def impossible(self, name: str, n: int) -> InvalidRequest | None:
        """A start no amount of waiting can admit (a group larger than the concurrency
        bound): a 400 at once rather than a wait that must time out."""
        m = self.models.get(name)
        cap = m.bounds.max_concurrent_rollouts if m is not None else None
        if cap is not None and n > cap:
            return InvalidRequest(
                f"A group of {n} sessions can never start: model {name!r} has "
                f"max_concurrent_rollouts={cap}. Start smaller groups or raise the bound.",
                code="group_too_large",
                param="group_size",
            )
        return None

    async def wait_for_room(self, name: str, n: int, wait_s: float) -> None:
        """Return once `n` sessions fit (the caller reserves them at once, before any other
        await), or raise the refusal once `wait_s` has passed."""
        refusal = self.try_admit(name, n)
        if refusal is None:
            return
        deadline = time.monotonic() + min(max(0.0, wait_s), MAX_WAIT_S)
        m = self.model(name)
        m.waiting += 1
        try:
            while refusal is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise refusal
                if m.changed is None:
                    m.changed = asyncio.Event()
                event = m.changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
                m = self.model(name)
                refusal = self.try_admit(name, n)
        finally:
            m.waiting -= 1

    def admitted(self, name: str, session_ids: Iterable[str]) -> None:
        m = self.model(name)
        for sid in session_ids:
            if self.sessions.get(sid) == name:
                continue
            self.sessions[sid] = name
            m.running.add(sid)
            m.admitted_total += 1
            self.dirty_sessions.add(sid)

    def refused(self, name: str) -> None:
        self.model(name).refused_total += 1

    # -- sessions leaving -------------------------------------------------

    def end(self, session_ids: Iterable[str]) -> int:
        """`end_session`: running -> ended."""
        count = 0
        for sid in session_ids:
            name = self.sessions.get(sid)
            m = self.models.get(name) if name is not None else None
            if m is None or sid not in m.running:
                continue
            m.running.discard(sid)
            m.ended.add(sid)
            self.dirty_sessions.add(sid)
            m.wake()
            count += 1
        return count

    def settle(self, session_ids: Iterable[str], *, consumed: bool) -> None:
        """Admitted sessions whose pins were released: consumed (exported and acknowledged)
        or dropped."""
        for sid in session_ids:
            name = self.sessions.pop(sid, None)
            if name is None:
                continue
            self.dirty_sessions.add(sid)
            m = self.models.get(name)
            if m is None:
                continue
            m.running.discard(sid)
            m.ended.discard(sid)
            if consumed:
                m.consumed += 1
                self.dirty_models.add(name)
            m.wake()

    # -- status and persistence -------------------------------------------

    def state(self, name: str) -> router_pb2.AdmissionState:
        m = self.models.get(name) or ModelAdmission()
        left, which = m.room() if m.bounds.active else (None, "")
        return router_pb2.AdmissionState(
            model=name,
            settings=m.bounds.to_proto(),
            version=m.version,
            running=len(m.running),
            ended=len(m.ended),
            consumed=m.consumed,
            capacity_left=-1 if left is None else left,
            limited_by=which,
            admitted_total=m.admitted_total,
            refused_total=m.refused_total,
            waiting=m.waiting,
        )

    def session_row(self, sid: str) -> tuple[str, int] | None:
        """(model, ended) of an admitted session, for the store; None once it is gone."""
        name = self.sessions.get(sid)
        if name is None:
            return None
        m = self.models.get(name)
        return name, int(m is not None and sid in m.ended)

    def load(
        self,
        models: Iterable[tuple[str, dict[str, Any]]],
        sessions: Iterable[tuple[str, str, int]],
        pinned: dict[str, str],
    ) -> None:
        """Replace the ledger with stored rows. An admitted session without a pin any more
        (released while the ledger's row was not yet written) is dropped, and marked dirty
        so the store forgets it too."""
        self.models.clear()
        self.sessions.clear()
        for name, doc in models:
            b = doc.get("bounds") or {}
            self.models[name] = ModelAdmission(
                bounds=Bounds(**{k: b.get(k) for k in _FIELDS}),
                version=int(doc.get("version", 0)),
                consumed=int(doc.get("consumed", 0)),
            )
        for sid, name, ended in sessions:
            if sid not in pinned:
                self.dirty_sessions.add(sid)
                continue
            m = self.model(name)
            self.sessions[sid] = name
            (m.ended if ended else m.running).add(sid)

    def mark_all_dirty(self) -> None:
        self.dirty_models.update(self.models)
        self.dirty_sessions.update(self.sessions)
