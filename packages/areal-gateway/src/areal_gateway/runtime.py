"""What one running gateway holds: settings, the key check, clients, caches, metrics.

Built once per app and reached by the endpoints as `request.app.state.gateway`. The gRPC
channels and the HTTP client are made inside the serving event loop (`start`) and closed by
`aclose` (idempotent), the last step of a shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time

from areal_gateway import __version__
from areal_gateway.auth import Authenticator
from areal_gateway.catalog import ModelCatalog
from areal_gateway.clients import AgentProxyPool, ProxyPool, RouterClient
from areal_gateway.external import ExternalForwarder
from areal_gateway.health import ServiceHealth
from areal_gateway.metrics import Metrics
from areal_gateway.openai.responses.store import ResponseStore, open_store
from areal_gateway.routing import RouteTable
from areal_gateway.settings import SESSION_KEY_SECRET_ENV, Settings
from areal_runtime.errors import InternalAuthFailed, ServiceError
from areal_runtime.offload import Offload
from areal_runtime.session_keys import SessionKeys

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.version = __version__
        self.pid = os.getpid()
        # Lets the CLI check that the port it polls is served by the process it started.
        self.instance = secrets.token_hex(8)
        self.started_at = time.time()
        if not settings.session_key_secret:
            log.warning(
                "%s is not set: session keys are signed with a random key of this process "
                "and stop working when it exits (the areal CLI sets it, so a restarted gateway "
                "keeps accepting them)",
                SESSION_KEY_SECRET_ENV,
            )
        self.auth = Authenticator(
            settings.admin_api_key, SessionKeys.from_secret(settings.session_key_secret)
        )
        self.metrics = Metrics()
        self.draining = False
        # Huge generation bodies are parsed in a child process (openai/screen.py), started
        # when the first one arrives.
        self.screen = Offload("areal_gateway.openai.screen:make", {}, name="body screen")
        # Stored responses (openai/responses/store.py): this process's own, or the file every
        # gateway of the service shares (--response-store).
        self.responses: ResponseStore = open_store(settings.response_store)
        self._router: RouterClient | None = None
        self._proxies: ProxyPool | None = None
        self._catalog: ModelCatalog | None = None
        self._external: ExternalForwarder | None = None
        self._agents: AgentProxyPool | None = None  # agent mode
        self._routes: RouteTable | None = None
        self._health: ServiceHealth | None = None
        self._closed = False

    # The clients exist between start() and aclose(); endpoints only run in between.
    @property
    def router(self) -> RouterClient:
        assert self._router is not None, "gateway not started"
        return self._router

    @property
    def health(self) -> ServiceHealth:
        assert self._health is not None, "gateway not started"
        return self._health

    @property
    def routes(self) -> RouteTable:
        assert self._routes is not None, "gateway not started"
        return self._routes

    @property
    def proxies(self) -> ProxyPool:
        assert self._proxies is not None, "gateway not started"
        return self._proxies

    @property
    def catalog(self) -> ModelCatalog:
        assert self._catalog is not None, "gateway not started"
        return self._catalog

    @property
    def external(self) -> ExternalForwarder:
        assert self._external is not None, "gateway not started"
        return self._external

    @property
    def agents(self) -> AgentProxyPool:
        assert self._agents is not None, "gateway not started"
        return self._agents

    async def start(self) -> None:
        if self._router is not None:
            return
        token = self.settings.internal_token
        self._router = RouterClient(self.settings.router_addr, token)
        self._proxies = ProxyPool(token, streams=self.settings.proxy_streams)
        self._routes = RouteTable(self._router)
        self._catalog = ModelCatalog(self._router)
        self._health = ServiceHealth(self._router)
        self._external = ExternalForwarder()
        self._agents = AgentProxyPool(token)
        # Connect to the router before serving (the CLI starts it first), so the first
        # request does not pay for the connection; a router not up yet is no error here.
        if not await self._router.warm():
            log.warning(
                "router %s not reachable yet; requests will retry it", self.settings.router_addr
            )
            return
        # One real RPC with the internal token: a gateway whose token the router refuses
        # would otherwise start healthy and fail every request. InternalAuthFailed propagates
        # (server.run turns it into a one-line error and a non-zero exit); anything else is
        # the router's momentary trouble, which requests will meet and report themselves.
        try:
            await self._router.list_models()
        except InternalAuthFailed:
            raise
        except ServiceError as exc:
            log.warning("router %s: start-up probe failed: %s", self.settings.router_addr, exc)

    async def aclose(self, grace: float | None = None) -> None:
        await self.screen.close()
        await self.responses.aclose()
        if self._closed or self._router is None:
            self._closed = True
            return
        self._closed = True
        assert self._catalog is not None and self._proxies is not None
        assert self._external is not None
        await self._catalog.aclose()
        if self._health is not None:
            await self._health.aclose()
        await asyncio.gather(
            self._proxies.close(grace),
            self._router.close(grace),
            self._external.aclose(),
            self.agents.close(grace),
            return_exceptions=True,
        )
        log.info("clients closed")
