"""`serve(settings)`: run the gateway until SIGTERM/SIGINT, then shut down in order.

The socket is bound here (so `--port 0` works and the real port is known), handed to uvicorn
(httptools and uvloop when importable), and the ready file is written once the app serves.
Signals are handled here, not by uvicorn: uvicorn would re-raise the signal after its
shutdown and the process would not exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import math
import signal
import socket
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from areal_gateway.app import create_app
from areal_gateway.fastpath import GenerationFastPath
from areal_gateway.runtime import Gateway
from areal_gateway.settings import Settings, validate
from areal_runtime import tracing
from areal_runtime.errors import InternalAuthFailed
from areal_runtime.logs import mask
from areal_runtime.ready import write_ready_file

log = logging.getLogger("areal_gateway.server")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (`serve` owns SIGTERM/SIGINT)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            # Several gateways, one port: Linux hashes each new connection to one of the
            # listeners, and admits only sockets of the same user to the group.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def http_impl(settings: Settings) -> str | type[asyncio.Protocol]:
    """httptools with the slow- and idle-client limits (http_protocol.py). Without httptools,
    uvicorn's h11 (no such limits: httptools is a declared dependency)."""
    if importlib.util.find_spec("httptools") is None:
        return "h11"
    from areal_gateway.http_protocol import guarded_protocol

    return guarded_protocol(settings.request_read_timeout, settings.max_idle_connections_per_client)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def make_server(settings: Settings, app: Any) -> uvicorn.Server:
    config = uvicorn.Config(
        GenerationFastPath(app),
        http=http_impl(settings),
        lifespan="on",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=max(0, math.ceil(settings.drain_timeout)),
        timeout_keep_alive=30,
    )
    return _Server(config)


async def shutdown(
    server: uvicorn.Server, serving: asyncio.Task[None], gateway: Gateway, settings: Settings
) -> None:
    """The ordered steps of a graceful stop."""
    # 1. Health answers "draining" (503) so a load balancer or the CLI sees us going.
    gateway.draining = True
    log.info("shutting down: draining in-flight requests (up to %.1f s)", settings.drain_timeout)
    # 2. Stop accepting; uvicorn closes the listener and idle connections, waits for in-flight
    #    responses up to the drain timeout, cancels what is left, then runs the app's lifespan
    #    shutdown.
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    # 3. Close the router/proxy channels and the external HTTP client (no-op when the
    #    lifespan shutdown already did).
    await gateway.aclose()
    tracing.shutdown()
    log.info("stopped")


async def run(settings: Settings) -> int:
    validate(settings)
    tracing.setup("areal-gateway")
    loop = asyncio.get_running_loop()
    sock = bind_socket(settings.host, settings.port, reuse_port=settings.reuse_port)
    port = sock.getsockname()[1]
    sockets = [sock]
    own_port = None
    if settings.own_port >= 0:
        try:
            own = bind_socket("127.0.0.1", settings.own_port)
        except BaseException:
            sock.close()
            raise
        sockets.append(own)
        own_port = own.getsockname()[1]
    app = create_app(settings)
    gateway: Gateway = app.state.gateway
    server = make_server(settings, app)
    try:
        # Here rather than in the app's lifespan (where it runs again as a no-op): a refused
        # internal token is a one-line error and a non-zero exit, not a startup traceback.
        await gateway.start()
    except InternalAuthFailed:
        log.error(
            "internal authentication with the router at %s failed: it refused this "
            "gateway's AREAL_INTERNAL_TOKEN (the router and the gateway need the same token)",
            settings.router_addr,
        )
        await gateway.aclose()
        for sk in sockets:
            sk.close()
        return 1

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        serving = asyncio.ensure_future(server.serve(sockets=sockets))
        while not server.started and not serving.done():
            await asyncio.sleep(0.005)
        if serving.done():
            serving.result()  # startup failed: raise what uvicorn raised
            log.error("the server stopped during startup")
            return 1
        write_ready_file(
            settings.ready_file or None,
            host=settings.host,
            port=port,
            version=gateway.version,
            mode=settings.mode,
            instance=gateway.instance,
            router_addr=settings.router_addr,
            own_port=own_port,
        )
        log.info(
            "listening on http://%s:%d%s%s (mode %s, router %s, admin key %s, http %s)",
            settings.host,
            port,
            " (shared)" if settings.reuse_port else "",
            f" and http://127.0.0.1:{own_port}" if own_port else "",
            settings.mode,
            settings.router_addr,
            mask(settings.admin_api_key),
            "httptools" if importlib.util.find_spec("httptools") else "h11",
        )
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait((stopper, serving), return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        await shutdown(server, serving, gateway, settings)
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        for sk in sockets:
            sk.close()


def serve(settings: Settings) -> int:
    """Run until stopped; the exit status (0 after a graceful stop)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(run(settings))
