"""The engine loop: one client request may take several engine attempts.

Pause aborts in-flight generations at the engine; each aborted request then waits for
Continue and is resubmitted with `prompt + tokens so far` and the remaining budget, so the
client sees a slower answer, never an error or a truncation. Every output token is stamped
with the weight version current when it was generated (`GenerationRecord.versions`).
Nothing is ever retried after an engine's answer about the request. An engine lost under a
request (`EngineError.lost`: it died or became unreachable) is different: the request
continues on another replica's engine through its proxy (migration.py), the same way, prompt
+ tokens so far and the remaining budget, unless it may not move (then a 503
`migration_failed` says why).

A constrained generation (JSON schema, regex, forced tool call) cannot be resumed that way:
the engine's grammar would start again at the continuation. It starts over from its prompt
instead, its partial output dropped -- unless a stream already sent part of it, which then
ends with a 503 asking for the request again (the only case a pause is an error).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from areal_proxy.engine.base import EngineClient, EngineError, GenerationRequest
from areal_proxy.generation.migration import Retired
from areal_runtime import tracing

if TYPE_CHECKING:
    from areal_proxy.generation.migration import Migrator

log = logging.getLogger(__name__)


def new_rid() -> str:
    return os.urandom(12).hex()


@dataclass(slots=True)
class GenerationRecord:
    """Everything generated for one client request (what the RL recording layer persists)."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | None = None
    # Engine request id of the current attempt (abort targets it).
    engine_rid: str = ""
    attempts: int = 0
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    # `prompt_ids` already encoded as a JSON array, when the prompt builder had it (a long
    # session's prompt is mostly its previous one, whose encoding is kept): the engine
    # request then costs what is new, not the whole prompt's encoding.
    prompt_json: bytes | None = None
    # Which replica generated which output tokens, as runs: (index of the run's first output
    # token, proxy id), in order; "" is this proxy (its own engine). One run unless the
    # request migrated to another replica.
    replicas: list[tuple[int, str]] = field(default_factory=list)
    # Replicas the request moved to after its engine was lost (migration).
    migrations: int = 0
    # Choices of the client's request generated together with this one (n, or several
    # prompts): more than one is never migrated (the others would go on where they are).
    together: int = 1
    # A continuation of another replica's request (ContinueGeneration): it never moves on
    # from here; a lost engine fails it, and its caller picks the next replica.
    pinned: bool = False

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    def restart(self) -> None:
        """Forget the output so far (a constrained generation starts over)."""
        self.token_ids.clear()
        self.logprobs.clear()
        self.top_logprobs.clear()
        self.versions.clear()
        self.replicas.clear()
        self.first_token_at = None

    def add(
        self,
        ids: list[int],
        lps: list[float],
        tops: list[list[tuple[int, float]]],
        version: int,
        replica: str = "",
    ) -> None:
        if not ids:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if not self.replicas or self.replicas[-1][1] != replica:
            self.replicas.append((len(self.token_ids), replica))
        self.token_ids.extend(ids)
        self.logprobs.extend(lps)
        self.top_logprobs.extend(tops)
        self.versions.extend([version] * len(ids))


@dataclass(slots=True)
class Step:
    """Tokens that arrived together; finish_reason is set on the last step only."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    matched_stop: int | None = None


def _aligned(
    ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]], want_tops: bool
) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Keep only tokens that came with their logprobs (an aborted engine chunk may
    carry an id without one; it is regenerated on resubmission)."""
    n = min(len(ids), len(lps))
    if want_tops:
        n = min(n, len(tops))
    return ids[:n], lps[:n], tops[:n] if want_tops else [[] for _ in range(n)]


class GenerationController:
    """Per proxy: weight version, pause state, in-flight requests, and the engine loop."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        version: int = 0,
        on_finish: Callable[[GenerationRecord], None] | None = None,
        migrator: Migrator | None = None,
    ) -> None:
        self.engine = engine
        self.version = version
        self.total_requests = 0
        self.inflight: dict[str, GenerationRecord] = {}
        self._paused = False
        self._running = asyncio.Event()
        self._running.set()
        self._pause_epoch = 0
        self._control = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        # Called once per finished request (metrics now; the RL recording layer later).
        self.on_finish = on_finish
        # Where a request whose engine was lost goes next (None: nowhere, the lost engine's
        # error is the request's).
        self.migrator = migrator
        # Engine request id -> the peer carrying it, while an attempt runs on a peer (an
        # abort by id goes there, not to this proxy's engine).
        self._peer_rids: dict[str, EngineClient] = {}
        # Retired (graceful drain, `retire`): attempts start on peers, never on this proxy's
        # engine; `_on_engine` holds the requests with an attempt running on it (rec.rid).
        self.retired = False
        self._on_engine: set[str] = set()

    # ---- state -------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def inflight_tokens(self) -> int:
        return sum(len(r.prompt_ids) + max(r.remaining, 0) for r in self.inflight.values())

    def set_version(self, version: int) -> None:
        self.version = version

    @property
    def on_engine(self) -> int:
        """Requests with an attempt running on this proxy's engine now."""
        return len(self._on_engine)

    # ---- retirement (graceful drain) -----------------------------------------------------

    def retire(self) -> None:
        """From now on every attempt starts on a peer (migration.py); attempts already on
        this proxy's engine go on until they finish or `evacuate` moves them."""
        if not self.retired:
            self.retired = True
            log.info(
                "retired: new attempts run on other replicas (%d on the engine)", self.on_engine
            )

    async def evacuate(self) -> int:
        """Abort every attempt still on this proxy's engine: each one's request then moves to
        a peer with the tokens it has (or fails `migration_failed` where it may not move)."""
        rids = [r.engine_rid for rid in self._on_engine if (r := self.inflight.get(rid))]
        await asyncio.gather(*(self._abort(e) for e in rids if e))
        return len(rids)

    # ---- control -----------------------------------------------------------------------

    async def pause(self) -> None:
        async with self._control:
            await self._pause()

    async def resume(self) -> None:
        async with self._control:
            await self._resume()

    async def update_weights(self, path: str, version: int = -1) -> int:
        """Pause, load the weights, bump the version, continue (continue also on failure).

        A proxy that was paused before stays paused: whoever paused it continues it.
        """
        if self.retired:
            # Its requests run on peers, stamped with the peers' versions; the number kept
            # here is what this proxy reports, kept in step with the others.
            self.version = self.version + 1 if version < 0 else version
            return self.version
        update = getattr(self.engine, "update_weights_from_disk", None)
        if update is None:
            raise EngineError("this engine client cannot update weights from disk", status=409)
        async with self._control:
            was_paused = self._paused
            await self._pause()
            try:
                new = self.version + 1 if version < 0 else version
                await update(path, str(new))
                self.version = new
                log.info("weights updated from %s; version %d", path, new)
            finally:
                if not was_paused:
                    await self._resume()
            return self.version

    async def _pause(self) -> None:
        if self._paused:
            return
        self._paused = True
        self._pause_epoch += 1
        self._running.clear()
        try:
            pause = getattr(self.engine, "pause", None)
            if self.retired and not self._on_engine:
                pass  # nothing on its engine (which may be gone); peers pause their own
            elif pause is not None:
                await pause(mode="abort")
            else:  # an engine without pause: abort our own requests one by one
                await asyncio.gather(
                    *(
                        self.engine.abort(r.engine_rid)
                        for r in self.inflight.values()
                        if r.engine_rid
                    )
                )
        except BaseException:
            self._paused = False
            self._running.set()
            raise
        log.info("generation paused (%d in flight)", len(self.inflight))

    async def _resume(self) -> None:
        if not self._paused:
            return
        resume = getattr(self.engine, "resume", None)
        if resume is not None:
            try:
                await resume()  # on failure the proxy stays paused, as the engine is
            except EngineError:
                if not self.retired:  # a retired proxy's engine may be gone: nothing to do
                    raise
        self._paused = False
        self._running.set()
        log.info("generation continued (%d waiting)", len(self.inflight))

    # ---- generation --------------------------------------------------------------------

    def start(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        prompt_json: bytes | None = None,
        *,
        together: int = 1,
    ) -> GenerationRecord:
        """A new request's record; `together`: how many choices of the client's request are
        generated side by side with it (more than one: never migrated)."""
        rec = GenerationRecord(
            new_rid(), prompt_ids, max_new_tokens, prompt_json=prompt_json, together=together
        )
        self.inflight[rec.rid] = rec
        self.total_requests += 1
        return rec

    def finish(self, rec: GenerationRecord) -> None:
        """Forget the request; if the engine may still be generating it, abort it there."""
        if self.inflight.pop(rec.rid, None) is None:
            return
        # On a peer, the closed continuation call aborted the peer's engine request already.
        if rec.finish_reason is None and rec.engine_rid and not rec.migrations:
            self.abort_later(rec.engine_rid)
        if self.on_finish is not None:
            self.on_finish(rec)

    def abort_later(self, engine_rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(engine_rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, engine_rid: str) -> None:
        log.debug("aborting engine request %s", engine_rid)
        try:
            await self._peer_rids.get(engine_rid, self.engine).abort(engine_rid)
        except Exception as e:  # the request may already be gone; nothing to undo
            log.warning("engine abort of %s failed: %s", engine_rid, e)

    async def wait_background(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _attempt(
        self, rec: GenerationRecord, template: GenerationRequest, engine: EngineClient | None = None
    ) -> GenerationRequest:
        rec.attempts += 1
        rec.engine_rid = f"{rec.rid}-{rec.attempts}"
        if engine is not None and engine is not self.engine:
            self._peer_rids[rec.engine_rid] = engine
        if rec.token_ids:
            ids, encoded = rec.prompt_ids + rec.token_ids, None
        else:
            ids, encoded = rec.prompt_ids, rec.prompt_json
        return replace(
            template,
            input_ids=ids,
            input_ids_json=encoded,
            max_new_tokens=rec.remaining,
            rid=rec.engine_rid,
        )

    def _by_pause(self, finish: str | None, epoch: int) -> bool:
        return finish == "abort" and (self._paused or self._pause_epoch != epoch)

    async def _migrate(
        self,
        rec: GenerationRecord,
        template: GenerationRequest,
        engine: EngineClient,
        err: EngineError,
        tried: set[str],
    ) -> EngineClient:
        """The engine `rec` goes on with after `err` from `engine`: a peer when the engine was
        lost and the request may move (migration.py); otherwise `err` (or why it may not
        move) is raised."""
        if not err.lost or self.migrator is None or rec.pinned:
            raise err
        return await self.migrator.next_engine(rec, template, engine, err, tried)

    def _retired_here(self, engine: EngineClient) -> bool:
        return self.retired and engine is self.engine

    async def _wait_running(self) -> None:
        """Wait while generation is paused (a weight update), in a span of its own."""
        if self._running.is_set():
            return
        with tracing.span("proxy.wait", reason="paused"):
            await self._running.wait()

    async def stream(
        self, rec: GenerationRecord, template: GenerationRequest
    ) -> AsyncGenerator[Step, None]:
        """Steps as the engine produces tokens, across pause/resubmission and migration."""
        async with aclosing(self._stream_on(rec, template, self.engine, set())) as steps:
            async for step in steps:
                yield step

    async def _stream_on(
        self,
        rec: GenerationRecord,
        template: GenerationRequest,
        engine: EngineClient,
        tried: set[str],
    ) -> AsyncGenerator[Step, None]:
        want_tops = template.top_logprobs > 0
        sent = False
        while True:
            await self._wait_running()
            if rec.remaining <= 0:
                rec.finish_reason = "length"
                yield Step([], [], [], "length")
                return
            if self._retired_here(engine):
                engine = await self._migrate(rec, template, engine, Retired(), tried)
            epoch = self._pause_epoch
            # Weights change only while paused, and a pause ends every attempt: all tokens of
            # this attempt come from the weights current now, however late they are read. A
            # peer's tokens carry the version the peer made them with.
            version = self.version
            req = self._attempt(rec, template, engine)
            local = engine is self.engine
            if local:
                self._on_engine.add(rec.rid)
            resubmit = False
            try:
                chunks_in = tracing.stream_span(
                    "proxy.engine", engine.generate_stream(req), kind=tracing.CLIENT, **_engine(req)
                )
                async with aclosing(chunks_in) as chunks:  # type: ignore[type-var]
                    async for chunk in chunks:
                        by_pause = self._by_pause(chunk.finish_reason, epoch)
                        # Aborted by `evacuate`: the request moves on with what it has.
                        moved = (
                            local
                            and self.retired
                            and not by_pause
                            and chunk.finish_reason == "abort"
                        )
                        ids, lps, tops = chunk.token_ids, chunk.logprobs, chunk.top_logprobs
                        if (
                            by_pause
                            or moved
                            or len(lps) != len(ids)
                            or (want_tops and len(tops) != len(ids))
                        ):
                            ids, lps, tops = _aligned(ids, lps, tops, want_tops)
                        elif not want_tops:
                            tops = []
                        if by_pause and template.constraint is not None:
                            if sent:
                                raise EngineError(
                                    "a weight update interrupted this constrained generation "
                                    "after part of it was sent, and a constrained output cannot "
                                    "be resumed: send the request again",
                                    status=503,
                                )
                            rec.restart()
                            resubmit = True
                            break
                        if chunk.replica:
                            rec.add(ids, lps, tops, _version(chunk.weight_version), chunk.replica)
                        else:
                            rec.add(ids, lps, tops, version)
                        if moved:
                            if ids:
                                sent = True
                                yield Step(ids, lps, tops)
                            raise Retired()
                        if by_pause:
                            if ids:
                                yield Step(ids, lps, tops)
                            resubmit = True
                            break
                        if chunk.finish_reason is not None:
                            rec.finish_reason = chunk.finish_reason
                            rec.matched_stop = chunk.matched_stop
                            yield Step(ids, lps, tops, chunk.finish_reason, chunk.matched_stop)
                            return
                        if ids:
                            sent = True
                            yield Step(ids, lps, tops)
                if not resubmit:
                    raise EngineError(
                        "engine stream ended without a finish reason", status=502, lost=True
                    )
            except EngineError as e:
                engine = await self._migrate(rec, template, engine, e, tried)
                continue
            finally:
                self._peer_rids.pop(req.rid or "", None)
                if local:
                    self._on_engine.discard(rec.rid)
            log.debug("request %s aborted by pause after %d tokens", rec.rid, len(rec.token_ids))

    async def generate(self, rec: GenerationRecord, template: GenerationRequest) -> None:
        """The whole generation into `rec` (one engine call unless a pause interrupts it). On a
        lost engine it continues on a peer, streamed (each step with the peer's version)."""
        want_tops = template.top_logprobs > 0
        while True:
            await self._wait_running()
            if rec.remaining <= 0:
                rec.finish_reason = "length"
                return
            epoch = self._pause_epoch
            version = self.version  # as in stream(): the attempt's weights
            tried: set[str] = set()
            if self.retired:
                await self._finish_on_peer(rec, template, Retired(), tried)
                return
            self._on_engine.add(rec.rid)
            try:
                req = self._attempt(rec, template)
                with tracing.span("proxy.engine", kind=tracing.CLIENT, **_engine(req)) as sp:
                    res = await self.engine.generate(req)
                    sp.set(output_tokens=len(res.token_ids), finish_reason=res.finish_reason)
            except EngineError as e:
                # A whole answer that died left nothing usable: the peer generates from the
                # prompt + whatever tokens earlier (paused) attempts kept.
                await self._finish_on_peer(rec, template, e, tried)
                return
            finally:
                self._on_engine.discard(rec.rid)
            by_pause = self._by_pause(res.finish_reason, epoch)
            if not by_pause and self.retired and res.finish_reason == "abort":
                # Evacuated: what it made is kept, the rest is generated on a peer.
                ids, lps, tops = _aligned(res.token_ids, res.logprobs, res.top_logprobs, want_tops)
                rec.add(ids, lps, tops, version)
                await self._finish_on_peer(rec, template, Retired(), tried)
                return
            if by_pause and template.constraint is not None:
                rec.restart()
                continue
            ids, lps, tops = _aligned(res.token_ids, res.logprobs, res.top_logprobs, want_tops)
            rec.add(ids, lps, tops, version)
            if not by_pause:
                rec.finish_reason = res.finish_reason
                rec.matched_stop = getattr(res, "matched_stop", None)
                return

    async def _finish_on_peer(
        self, rec: GenerationRecord, template: GenerationRequest, err: EngineError, tried: set[str]
    ) -> None:
        """The rest of a whole answer, streamed from a peer (or `err` / why it may not move)."""
        peer = await self._migrate(rec, template, self.engine, err, tried)
        async with aclosing(self._stream_on(rec, template, peer, tried)) as steps:
            async for _ in steps:
                pass


def _engine(req: GenerationRequest) -> dict[str, object]:
    """An engine call's span attributes (its engine request id and prompt size)."""
    if not tracing.ON:
        return {}
    return {"engine_rid": req.rid, "prompt_tokens": len(req.input_ids)}


def _version(weight_version: str) -> int:
    """A peer's version as it reported it (a number; anything else reads as 0)."""
    try:
        return int(weight_version)
    except ValueError:
        return 0
