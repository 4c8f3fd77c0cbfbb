"""Build the proxy (create_server) and run it until SIGTERM/SIGINT (serve)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from areal_proxy import __version__
from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.engine import make_engine_client
from areal_proxy.engine.base import EngineClient
from areal_proxy.engine.progress import EngineProgress, TrackedEngine
from areal_proxy.generation.controller import GenerationController
from areal_proxy.generation.migration import Migrator
from areal_proxy.inference import InferenceConfig, InferenceHandler
from areal_proxy.output.parsing import NO_PARSER, check_parsers
from areal_proxy.prompt.chat_template import PromptBuilder
from areal_proxy.prompt.incremental import SessionPrompts
from areal_proxy.recording.recorder import Recorder
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.recording.store import Store
from areal_proxy.serving.engine_health import EngineHealth
from areal_proxy.serving.metrics import ProxyMetrics
from areal_proxy.serving.retirement import drain
from areal_proxy.serving.service import ProxyServicer, add_to_server
from areal_proxy.serving.state import ProxyState
from areal_proxy.settings import Settings
from areal_runtime import tls, tracing
from areal_runtime.auth import server_interceptors
from areal_runtime.offload import Offload
from areal_runtime.ready import write_ready_file

log = logging.getLogger("areal_proxy")

_MAX_MESSAGE = 64 * 1024 * 1024
# grpc.health names: "" (the whole server) and each service this mode serves.
# How long a retiring proxy shows NOT_SERVING on its health stream (see _announce_retired).
_BLIP_S = 0.1
_SERVICE_NAMES = (
    "",
    "areal.proxy.v1.InferenceProxyService",
    "areal.proxy.v1.ProxyStatusService",
)


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class ProxyServer:
    """One proxy: tokenizer, engine client, controller, gRPC server, health, metrics."""

    def __init__(self, settings: Settings, engine: EngineClient | None = None) -> None:
        self.settings = settings
        check_parsers(settings.tool_call_parser, settings.reasoning_parser)
        self.tokenizer = ModelTokenizer.from_dir(settings.tokenizer_path)
        # --tool-call-parser: `none` for no parser, empty for the one the chat template leaves
        # no doubt about (a template that ignores `tools` gets them in that parser's format:
        # tool_prompt.py).
        flag = settings.tool_call_parser
        chosen = None if not flag else ("" if flag == NO_PARSER else flag)
        prompts = (
            PromptBuilder(
                self.tokenizer, template_type=settings.chat_template_type, tool_parser=chosen
            )
            if self.tokenizer.chat_template
            else None
        )
        tool_parser = prompts.template.tool_parser if prompts is not None else (chosen or "")
        log.info(
            "tool-call parser: %s%s",
            tool_parser or "none",
            " (the chat template does not render tools: the proxy's default tool prompt)"
            if prompts is not None and prompts.template.writes_tool_prompt
            else "",
        )
        if prompts is None:
            log.warning(
                "no chat template in %s: chat requests will be refused", settings.tokenizer_path
            )
        # Every generation call reports the engine's progress, which tells a busy engine from
        # a lost one when its health check answers late (engine/progress.py).
        self.progress = EngineProgress(settings.engine_stall_timeout)
        self.engine = TrackedEngine(
            engine
            or make_engine_client(settings.engine, settings.engine_url, settings.request_timeout),
            self.progress,
        )
        # Blocking work runs off the event loop that serves streams, health and GetStats:
        # SQLite on one recording thread (one connection, statements in order; a small
        # turn's commit runs on the loop when that thread is idle, under the same lock: a
        # thread hop cost more than the write, recording/sessions.py), templating and
        # tokenizing big prompts on a small pool (tokenizers release the GIL).
        self.db_executor = ThreadPoolExecutor(1, thread_name_prefix="areal-proxy-db")
        self.cpu_executor = ThreadPoolExecutor(
            min(4, os.cpu_count() or 1), thread_name_prefix="areal-proxy-cpu"
        )
        self.store = Store(settings.resolved_db_path())
        self.book = SessionBook(
            self.store,
            ttl=settings.session_ttl,
            reward_finish_timeout=settings.set_reward_finish_timeout,
            max_live=settings.max_live_sessions,
            executor=self.db_executor,
            retention=settings.retention_seconds,
            lost_data=settings.lost_data,
            turn_cache_bytes=settings.prompt_cache_mb << 20,
            proxy_id=settings.proxy_id,
        )
        self.metrics = ProxyMetrics(model=settings.model)
        self.migrator = Migrator(
            proxy_id=settings.proxy_id,
            model=settings.model,
            router_addr=settings.router_addr,
            limit=settings.migration_limit,
            on_outcome=lambda outcome: self.metrics.migrations.labels(outcome).inc(),
        )
        # The controller's collaborators are built first and handed to it: nothing edits it
        # after construction.
        self.controller = GenerationController(
            self.engine, on_finish=self.metrics.observe_finished, migrator=self.migrator
        )
        self.state = ProxyState(
            model=settings.model,
            engine_url=settings.engine_url,
            proxy_id=settings.proxy_id,
            retired=settings.retired,
        )
        if settings.retired:
            self.controller.retire()
        # Huge prompts that cannot fit are found by a child process (screen.py), started
        # when the first one arrives.
        self.screen = Offload(
            "areal_proxy.prompt.fit_screen:make",
            {
                "tokenizer_path": str(settings.tokenizer_path),
                "template_type": settings.chat_template_type,
                "context_length": settings.context_length,
            },
            name="prompt screen",
        )
        # One continuation of session prompts, shared by the prelude that builds a turn's
        # prompt and the recorder that keeps its state for the next turn.
        session_prompts = SessionPrompts(prompts, self.tokenizer) if prompts is not None else None
        handler = InferenceHandler(
            InferenceConfig(
                model=settings.model,
                context_length=settings.context_length,
                engine_max_tokens=settings.engine_max_tokens,
                tool_call_parser=tool_parser,
                reasoning_parser=settings.reasoning_parser,
                forced_call_token_ids=settings.forced_call_token_ids,
            ),
            self.tokenizer,
            prompts,
            self.controller,
            session_prompts=session_prompts,
            recorder=Recorder(self.book, session_prompts),
            executor=self.cpu_executor,
            screen=self.screen,
            on_prompt=self.metrics.observe_prompt,
        )
        self.metrics.watch_turn_cache(self.book.turns)
        self.engine_health = EngineHealth(
            self.engine,
            self.state,
            self.metrics.engine_healthy,
            learn_limit=handler.learn_engine_limit,
            publish=self._publish_engine,
            progress=self.progress,
            busy_gauge=self.metrics.engine_busy,
        )
        self.metrics.engine_silent.set_function(self.progress.silent_for)
        self.servicer = ProxyServicer(  # type: ignore[abstract]
            handler=handler,
            controller=self.controller,
            metrics=self.metrics,
            state=self.state,
            engine_health=self.engine_health,
            request_timeout=settings.request_timeout,
            book=self.book,
            max_inflight=settings.max_inflight,
            on_retired=self._announce_retired,
        )
        self.metrics.stream_held_results.set_function(self.servicer.held_results)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            interceptors=server_interceptors(),
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE),
                ("grpc.max_send_message_length", _MAX_MESSAGE),
                # The gateway's Generate stream stays open while idle or while a long
                # generation sends nothing, and its keepalive pings (every 30 s) must not
                # count as abuse (gRPC's default would end the stream after a few).
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        add_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self.metrics_port = -1
        self._health_task: asyncio.Task[None] | None = None
        self._expiry_task: asyncio.Task[None] | None = None
        # Set once start() has published the first grpc.health status.
        self._serving_set = False

    async def start(self) -> int:
        s = self.settings
        self.port = tls.bind(self.server, _bind_address(s.host, s.port))
        if not self.port:
            raise OSError(f"cannot listen on {s.host}:{s.port}")
        await self.server.start()
        self.metrics_port = self.metrics.start(s.host, s.metrics_port)
        await self._check_engine()
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        self._expiry_task = asyncio.get_running_loop().create_task(self._expiry_loop())
        await self._set_serving(self.state.engine_healthy)
        self._serving_set = True
        log.info(
            "listening on %s:%d (metrics %d), engine %s %s, model %s",
            s.host,
            self.port,
            self.metrics_port,
            s.engine,
            s.engine_url,
            s.model,
        )
        return self.port

    async def _check_engine(self) -> None:
        """Check the engine now (or wait for the check in flight): engine_health.py."""
        await asyncio.shield(self.engine_health.check())

    async def _publish_engine(self, ok: bool) -> None:
        if self._serving_set:
            await self._set_serving(ok)

    async def _announce_retired(self) -> None:
        """A blip on the health stream the router watches: it polls at once, reads `draining`
        and sends this proxy no new session from then on (it stays SERVING for the turns of
        the sessions pinned here)."""
        if self.state.draining or not self._serving_set:
            return
        for name in _SERVICE_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        # Health watchers send only the latest status: let them send this one first.
        await asyncio.sleep(_BLIP_S)
        await self._set_serving(True)

    async def _set_serving(self, ok: bool) -> None:
        """The grpc.health status follows the engine's: the router watches it (a push), so a
        proxy whose engine failed is unroutable at once. A draining proxy stays NOT_SERVING."""
        if self.state.draining:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok or self.state.retired
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in _SERVICE_NAMES:
            await self.health.set(name, status)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.engine_health_interval)
            try:
                await self._check_engine()
            except Exception:  # never let the poller die
                log.exception("engine health check failed unexpectedly")

    async def _expiry_loop(self) -> None:
        """End RL sessions idle longer than --session-ttl (their rows stay exportable)."""
        interval = max(1.0, min(self.settings.session_ttl / 10, 30.0))
        while True:
            await asyncio.sleep(interval)
            await self.expire_once()

    async def expire_once(self) -> None:
        """One expiry pass: end idle sessions, delete those past --retention-seconds. A
        failure (a locked or full database, a bug) is logged and the next pass tries again:
        one error must not end expiry for the life of the process."""
        s = self.settings
        try:
            ended = await self.book.call(self.book.expire)
            if ended:
                log.info("%d idle session(s) ended after %gs", len(ended), s.session_ttl)
        except Exception:
            log.exception("session expiry failed; retrying in the next pass")
        try:
            purged = await self.book.call(self.book.purge)
            if purged:
                log.info(
                    "%d ended, exported session(s) deleted after %gs",
                    len(purged),
                    s.retention_seconds,
                )
        except Exception:
            log.exception("deleting sessions past their retention failed; retrying next pass")

    async def shutdown(self) -> None:
        """Ordered: stop taking work, drain, stop serving, close the engine client."""
        s = self.settings
        # 1. New generation requests get 503; health and GetStats say draining.
        self.state.draining = True
        await self.health.enter_graceful_shutdown()
        log.info("draining %d request(s) for up to %gs", self.servicer.active, s.drain_timeout)
        # 2. Let in-flight requests finish; what is still on the engine then moves to
        #    another replica (when one takes it: every replica stops at `areal inf stop`)
        #    and gets another drain timeout there.
        if not await self.servicer.wait_idle(s.drain_timeout):
            if s.router_addr and s.migration_limit and self.controller.on_engine:
                await drain(self.controller, 0.0)
                idle = await self.servicer.wait_idle(s.drain_timeout)
            else:
                idle = False
            if not idle:
                log.warning(
                    "%d request(s) still running after the drain timeout: cancelled",
                    self.servicer.active,
                )
        # 3. Multiplexed streams end (they would otherwise hold the server's grace period);
        #    then stop the server: calls still running are cancelled (engine requests aborted).
        self.servicer.close_streams()
        await self.server.stop(grace=1.0)
        # 4. Background work: the health poller, engine aborts still on their way.
        for task in (self._health_task, self._expiry_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.engine_health.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.controller.wait_background(), 5.0)
        # 5. Close the engine client and the prompt screen, then the metrics endpoint.
        await self.engine.close()
        await self.migrator.close()
        await self.screen.close()
        # The recording thread finishes what it was given before the database closes.
        self.cpu_executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.db_executor.shutdown, wait=True)
        self.store.close()
        self.metrics.stop()
        log.info("stopped")


def create_server(settings: Settings, engine: EngineClient | None = None) -> ProxyServer:
    return ProxyServer(settings, engine)


async def serve(settings: Settings) -> int:
    tracing.setup("areal-proxy")
    server = create_server(settings)
    await server.start()
    write_ready_file(
        settings.ready_file,
        host=settings.host,
        port=server.port,
        version=__version__,
        metrics_port=server.metrics_port,
        proxy_id=settings.proxy_id,
        model=settings.model,
        engine_url=settings.engine_url,
        tool_call_parser=server.servicer.handler.config.tool_call_parser,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: shutting down")
    await server.shutdown()
    tracing.shutdown()
    return 0
