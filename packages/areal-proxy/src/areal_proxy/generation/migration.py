"""Token-preserving migration (docs/services.md, "Migration").

When this proxy's engine is lost under a request (`EngineError.lost`), the request continues
on another healthy replica of the same model, through that replica's proxy
(`engine/peer.py`): prompt + the tokens so far, the remaining budget, the same sampling.
`Migrator` decides whether a request may move and to which peer; the peers come from the
router (`RouterService.ListProxies`), healthy ones other than this proxy, in the router's
order, each tried at most once per request. `continue_steps` is the other side: this proxy
answering a peer's `ContinueGeneration` on its own engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from areal_proto.proxy.v1 import proxy_pb2
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_proxy.engine.base import EngineClient, EngineError, GenerationRequest
from areal_proxy.engine.peer import CHANNEL_OPTIONS, PeerEngine, request_from
from areal_runtime import tls, tracing
from areal_runtime.auth import call_metadata

if TYPE_CHECKING:
    from areal_proxy.generation.controller import GenerationController, GenerationRecord

log = logging.getLogger(__name__)

# The outcomes of areal_proxy_migrations_total (every series exists from the start).
OUTCOMES = (
    "continued",
    "refused_constraint",
    "refused_n",
    "refused_limit",
    "no_peer",
    "peer_failed",
)
# Seconds the router's list of peers is reused: a burst of requests losing one engine asks
# the router once, and a peer that just became unhealthy is dropped soon.
PEERS_TTL_S = 1.5
# Seconds for one ListProxies call (the router answers from memory).
ROUTER_TIMEOUT_S = 2.0


class MigrationFailed(EngineError):
    """The engine was lost and the request could not move to another replica: 503, code
    `migration_failed`, the message saying why."""

    code = "migration_failed"

    def __init__(self, message: str) -> None:
        super().__init__(message, status=503)


class Retired(EngineError):
    """Why a retired proxy's request runs elsewhere: its engine was handed back (graceful
    drain), which moves a request as a lost engine does."""

    def __init__(self) -> None:
        super().__init__(
            "this replica is retired (graceful drain): its engine takes no more work",
            status=503,
            lost=True,
        )


class Migrator:
    """Peers and the decision to move a request to one; one per proxy."""

    def __init__(
        self,
        *,
        proxy_id: str,
        model: str,
        router_addr: str = "",
        limit: int = 3,
        on_outcome: Any = None,
    ) -> None:
        self.proxy_id = proxy_id
        self.model = model
        self.router_addr = router_addr
        self.limit = limit
        # Called with the outcome label of every decision (metrics).
        self.on_outcome = on_outcome
        self._router: router_pb2_grpc.RouterServiceStub | None = None
        self._router_channel: grpc.aio.Channel | None = None
        self._peers: list[tuple[str, str]] = []
        self._peers_at = -1e9
        self._peers_error = ""
        self._lock = asyncio.Lock()
        # By address: one channel per peer, kept for the life of the proxy.
        self._engines: dict[str, PeerEngine] = {}
        # Decisions by outcome since start (a drain reports the refusals made during it).
        self.counts: dict[str, int] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    async def close(self) -> None:
        for engine in list(self._engines.values()):
            await engine.close()
        channels = list(self._channels.values())
        if self._router_channel is not None:
            channels.append(self._router_channel)
        for ch in channels:
            await ch.close()
        self._engines.clear()
        self._channels.clear()

    async def peers(self) -> list[tuple[str, str]]:
        """(proxy id, address) of the healthy other replicas of this model, in the router's
        order; cached for PEERS_TTL_S. Empty when the router cannot be asked (logged)."""
        loop = asyncio.get_running_loop()
        async with self._lock:
            if loop.time() - self._peers_at < PEERS_TTL_S:
                return self._peers
            if self._router is None:
                self._router_channel = tls.channel(self.router_addr)
                self._router = router_pb2_grpc.RouterServiceStub(self._router_channel)
            try:
                resp = await self._router.ListProxies(
                    router_pb2.ListProxiesRequest(
                        model=self.model, kind=router_pb2.PROXY_KIND_INFERENCE
                    ),
                    metadata=tracing.metadata(call_metadata()),
                    timeout=ROUTER_TIMEOUT_S,
                )
                self._peers_error = ""
                self._peers = [
                    (p.proxy_id, p.address)
                    for p in resp.proxies
                    if p.health == router_pb2.PROXY_HEALTH_HEALTHY
                    and p.proxy_id != self.proxy_id
                    and p.address
                ]
            except grpc.RpcError as e:
                detail = e.details() if hasattr(e, "details") else str(e)
                self._peers_error = f"the router at {self.router_addr} did not answer: {detail}"
                log.warning("migration: %s", self._peers_error)
                self._peers = []
            self._peers_at = loop.time()
            return self._peers

    def engine(self, proxy_id: str, address: str) -> PeerEngine:
        """The peer's engine client (one channel per address, kept)."""
        cached = self._engines.get(address)
        if cached is None or cached.proxy_id != proxy_id:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = tls.channel(address, options=CHANNEL_OPTIONS)
            cached = self._engines[address] = PeerEngine(proxy_id, address, channel)
        return cached

    async def next_engine(
        self,
        rec: GenerationRecord,
        template: GenerationRequest,
        failed: EngineClient,
        err: EngineError,
        tried: set[str],
    ) -> PeerEngine:
        """The peer `rec` continues on after `err` from `failed`, or MigrationFailed saying why
        it may not move. `tried`: proxy ids this request already went to (updated)."""
        if isinstance(failed, PeerEngine):
            self._count("peer_failed")
            log.warning(
                "migration: peer %s failed request %s after %d tokens: %s",
                failed.proxy_id,
                rec.rid,
                len(rec.token_ids),
                err,
            )
        # Choices generated together stay together; a retired proxy's new request has none
        # under way, so each of its choices starts on a peer.
        if rec.together > 1 and not (isinstance(err, Retired) and not rec.token_ids):
            self._refuse(
                rec,
                err,
                "refused_n",
                f"a request with {rec.together} choices generated together (n > 1 or several "
                "prompts) is not migrated",
            )
        if template.constraint is not None and rec.token_ids:
            self._refuse(
                rec,
                err,
                "refused_constraint",
                f"a constrained generation ({template.constraint[0]}) cannot resume on another "
                f"replica once it has output ({len(rec.token_ids)} tokens)",
            )
        if rec.migrations >= self.limit:
            self._refuse(
                rec,
                err,
                "refused_limit",
                f"the request already moved {rec.migrations} time(s), the limit "
                f"(--migration-limit {self.limit})"
                if self.limit
                else "migration is off (--migration-limit 0)",
            )
        if not self.router_addr:
            self._refuse(
                rec, err, "no_peer", "this proxy has no router (--router-addr) to find a peer"
            )
        for proxy_id, address in await self.peers():
            if proxy_id in tried:
                continue
            tried.add(proxy_id)
            rec.migrations += 1
            self._count("continued")
            log.warning(
                "migration: request %s continues on %s (%s) after %d tokens (move %d): %s",
                rec.rid,
                proxy_id,
                address,
                len(rec.token_ids),
                rec.migrations,
                err,
            )
            return self.engine(proxy_id, address)
        why = self._peers_error or (
            "no other healthy replica of this model"
            + (f" (tried {', '.join(sorted(tried))})" if tried else "")
        )
        self._refuse(rec, err, "no_peer", why)

    def _refuse(self, rec: GenerationRecord, err: EngineError, outcome: str, why: str) -> NoReturn:
        self._count(outcome)
        log.warning("migration of request %s refused: %s (%s)", rec.rid, why, err)
        raise MigrationFailed(f"migration refused: {why}; the engine was lost: {err}") from err


async def continue_steps(
    controller: GenerationController, msg: proxy_pb2.ContinueGenerationRequest, proxy_id: str
) -> AsyncGenerator[proxy_pb2.ContinueGenerationStep, None]:
    """A peer's request continued on this proxy's engine, through its own generation loop
    (pauses resubmit, versions stamp as for its own requests); nothing is recorded here. The
    engine request is aborted if the caller goes away (`controller.finish`)."""
    template = request_from(msg)
    rec = controller.start(template.input_ids, template.max_new_tokens)
    # Never moved again from here: the caller decides where its request goes next.
    rec.pinned = True
    log.debug("continuing request %s of a peer as %s", msg.rid or "-", rec.rid)
    try:
        async with aclosing(controller.stream(rec, template)) as steps:
            async for step in steps:
                n = len(step.token_ids)
                version = rec.versions[-1] if n else controller.version
                out = proxy_pb2.ContinueGenerationStep(
                    token_ids=step.token_ids,
                    logprobs=step.logprobs,
                    version=version,
                    finish_reason=step.finish_reason or "",
                    replica=proxy_id,
                )
                if step.matched_stop is not None:
                    out.matched_stop = step.matched_stop
                    out.has_matched_stop = True
                for top in step.top_logprobs:
                    out.top_logprobs.add().entries.extend(
                        proxy_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top
                    )
                yield out
    finally:
        controller.finish(rec)
