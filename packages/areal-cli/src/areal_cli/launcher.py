"""Starting components of a service and recording them as they start.

Shared by `areal inf` and `areal agent`. A Launcher spawns each component in
its own process group, records it in the service state at once (so a CLI that
is killed mid-launch leaves state that `stop` / `run --force` can clean up),
waits for it to be ready, and on any failure stops everything it started.
The shared `run` around it (lock, secrets, foreground watch) is service_run.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from areal_cli import state as st
from areal_cli import supervisor
from areal_cli.components import Component, LaunchError, http_url
from areal_cli.config import Config
from areal_cli.errors import CLIError
from areal_cli.http import gateway_healthy
from areal_cli.private_files import make_dir
from areal_cli.probes import gateway_url
from areal_cli.reconcile import terminate_components
from areal_cli.supervisor import SECRET_ENV

# The gateway reads its session-key signing secret from here (areal_runtime.session_keys
# SECRET_ENV; the CLI does not depend on the runtime package).
SESSION_KEY_SECRET_ENV = "AREAL_SESSION_KEY_SECRET"

LOG_LEVELS = ("debug", "info", "warning", "error")

BINARIES = {
    "gateway": "areal-gateway",
    "router": "areal-router",
    "proxy": "areal-proxy",
    "agent_worker": "areal-agent-worker",
}


# An agent service's data proxies are the areal-agent-proxy binary; the config key stays
# `proxy` (`[binaries] proxy` in agent/config.toml), the one it was before that binary existed.
AGENT_BINARIES = {**BINARIES, "proxy": "areal-agent-proxy"}


def resolve_binary(cfg: Config, key: str) -> str:
    """A service binary: `[binaries] <key>` in the config, else on PATH."""
    name = (AGENT_BINARIES if cfg.group == "agent" else BINARIES)[key]
    configured = cfg.get("binaries", key)
    if configured:
        path = os.path.expanduser(configured)
        found = shutil.which(path) if os.sep not in path else path
        if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
            raise CLIError(f"[binaries] {key} = '{configured}' is not an executable file")
        return found
    found = shutil.which(name)
    if not found:
        raise CLIError(
            f"{name} not found on PATH: install the {name} package (or activate the "
            f"environment that has it), or set [binaries] {key} = '/path/to/{name}' in "
            f"{cfg.group}/config.toml"
        )
    return found


# Each gateway is a process with its own channels to the router and every proxy; past this
# a service wants gateways on more machines, not more on one.
MAX_GATEWAYS = 64


def check_gateways(n: int) -> int:
    if not 1 <= n <= MAX_GATEWAYS:
        raise CLIError(f"--gateways must be between 1 and {MAX_GATEWAYS} (got {n})", 2)
    return n


def check_log_level(level: str) -> str:
    level = level.lower()
    if level not in LOG_LEVELS:
        raise CLIError(f"invalid --log-level '{level}' (choose from {', '.join(LOG_LEVELS)})", 2)
    return level


def self_identity(foreground: bool) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "start_time": supervisor.proc_start_time(os.getpid()) or 0,
        "foreground": foreground,
    }


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Launcher:
    """Spawns and records components of one service; `abort()` stops what it started."""

    def __init__(
        self,
        group: str,
        service: str,
        state: dict[str, Any],
        env: dict[str, str],
        gateway_env: dict[str, str] | None = None,
    ):
        self.group = group
        self.service = service
        self.state = state
        self.env = env  # secrets etc. for services (never on argv)
        # What only the gateway gets on top of `env` (the session-key secret): the router,
        # proxies and engines never need it.
        self.gateway_env = gateway_env or {}
        self.procs: dict[int, Any] = {}
        self.started: list[Component] = []
        self.began = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    # -- recording -------------------------------------------------------
    def save(self) -> None:
        st.save(self.group, self.service, self.state)

    def ready_file(self, name: str) -> Path:
        p = st.run_dir(self.group, self.service) / f"{name}.ready"
        make_dir(p.parent)
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
        return p

    def log_file(self, name: str) -> Path:
        return st.logs_dir(self.group, self.service) / f"{name}.log"

    def spawn(
        self,
        name: str,
        role: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        host: str = "",
        port: int = 0,
        meta: dict[str, Any] | None = None,
    ) -> tuple[Any, Component]:
        if name in self.state.setdefault("components", {}):
            raise CLIError(f"component '{name}' already exists in service '{self.service}'")
        env = env or {}
        # What the watchdog needs to respawn it: the environment without secrets (their
        # names only; the values are re-read from the 0600 secrets file) and the cwd.
        recorded = {
            "role": role,
            "started_at": time.time(),
            "env": {k: v for k, v in env.items() if k not in SECRET_ENV},
            "secret_env": sorted(k for k in env if k in SECRET_ENV),
            "cwd": os.getcwd(),
            **(meta or {}),
        }
        proc, comp = supervisor.spawn(
            name,
            argv,
            self.log_file(name),
            env=env,
            host=host,
            port=port,
            meta=recorded,
        )
        self.procs[proc.pid] = proc
        self.started.append(comp)
        self.state["components"][name] = comp.to_dict()
        self.save()
        return proc, comp

    def update(self, comp: Component, **fields: Any) -> None:
        for k, v in fields.items():
            if k in ("host", "port"):
                setattr(comp, k, v)
            else:
                comp.meta[k] = v
        self.state["components"][comp.name] = comp.to_dict()

    # -- waiting ---------------------------------------------------------
    def wait_all(
        self,
        items: list[tuple[Any, Component, Callable[[], bool]]],
        timeout: float,
        what: str = "ready",
    ) -> None:
        """Wait until every check passes; fail fast when any of the processes exits."""
        deadline = time.monotonic() + timeout
        pending = list(items)
        interval = 0.02
        while pending:
            for item in list(pending):
                proc, comp, check = item
                if proc.poll() is not None:
                    raise LaunchError(
                        comp.name, f"process exited (code {proc.returncode})", Path(comp.log)
                    )
                if check() and proc.poll() is None:
                    pending.remove(item)
            if not pending:
                return
            if time.monotonic() >= deadline:
                comp = pending[0][1]
                raise LaunchError(comp.name, f"not {what} after {timeout:g}s", Path(comp.log))
            time.sleep(interval)
            interval = min(0.25, interval * 1.3)

    @staticmethod
    def ready_check(path: Path, pid: int, out: dict[str, Any]) -> Callable[[], bool]:
        def check() -> bool:
            info = supervisor.read_ready_file(path)
            if info and info.get("pid") == pid and info.get("port"):
                out.update(info)
                return True
            return False

        return check

    # -- failure ---------------------------------------------------------
    def abort(self, comps: list[Component] | None = None, grace: float = 3.0) -> None:
        """Stop the given (default: all started) components and forget them in state."""
        comps = self.started if comps is None else comps
        terminate_components(comps, grace=grace, procs=self.procs)
        for c in comps:
            self.state.get("components", {}).pop(c.name, None)


class Interrupted(BaseException):
    """SIGTERM / SIGHUP received: stop like Ctrl-C."""


@contextlib.contextmanager
def stop_signals():
    """Turn SIGTERM and SIGHUP into Interrupted while the block runs."""

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def start_router_gateway(
    launcher: Launcher,
    *,
    router_bin: str,
    gateway_bin: str,
    host: str,
    port: int,
    admin_api_key: str,
    policy: str,
    common_args: list[str],
    gateway_args: list[str],
    timeout: Callable[[], float],
    router_host: str = "127.0.0.1",
    gateways: int = 1,
) -> None:
    """The router, then `gateways` gateways pointed at it; all recorded in the state once
    ready (a gateway once it answers as healthy).

    `common_args` go to both after `--ready-file`, `gateway_args` to the gateway before
    `--router-addr`; `timeout()` is asked before each wait (a group may count down). The
    router listens on `router_host`: loopback, or with Ray the CLI node's address, where the
    data proxies on other nodes reach it (migration asks it for their peers).
    """
    state = launcher.state
    ready = launcher.ready_file("router")
    state_file = st.run_dir(launcher.group, launcher.service) / "router-state.json"
    if state_file.exists():
        state_file.unlink()  # a new service starts with an empty registry
    argv = [router_bin, "--host", router_host, "--port", "0", "--ready-file", str(ready)]
    argv += [*common_args, "--policy", policy, "--state-file", str(state_file)]
    proc, router = launcher.spawn("router", "router", argv, env=launcher.env, host=router_host)
    info: dict[str, Any] = {}
    launcher.wait_all([(proc, router, Launcher.ready_check(ready, proc.pid, info))], timeout())
    address = f"{info.get('host') or '127.0.0.1'}:{info['port']}"
    launcher.update(router, port=int(info["port"]), address=address)
    state["router"] = {"address": address}
    launcher.save()

    shared = gateways > 1
    env = {**launcher.env, **launcher.gateway_env, "AREAL_ADMIN_API_KEY": admin_api_key}

    def start_one(name: str, at_port: int) -> tuple[Any, Component, Callable[[], bool]]:
        ready = launcher.ready_file(name)
        argv = [gateway_bin, "--host", host, "--port", str(at_port), "--ready-file", str(ready)]
        if shared:
            # One port for clients, shared by all; each gateway also has a loopback port of
            # its own, where the watchdog and `status` reach that one process.
            argv += ["--reuse-port", "--own-port", "0"]
        argv += [*common_args, *gateway_args, "--router-addr", address]
        proc, gw = launcher.spawn(
            name, "gateway", argv, env=env, host=host, port=at_port, meta={"shared": shared}
        )
        ginfo: dict[str, Any] = {}
        file_ok = Launcher.ready_check(ready, proc.pid, ginfo)

        def healthy() -> bool:
            if not file_ok():
                return False
            launcher.update(gw, port=int(ginfo["port"]), url=http_url(host, int(ginfo["port"])))
            return gateway_healthy(gateway_url(gw, ginfo), proc.pid)

        return proc, gw, healthy

    # The first one picks the port when it is 0; the others then share it.
    first = start_one("gateway", port)
    launcher.wait_all([first], timeout(), "healthy")
    port = first[1].port
    url = http_url(host, port)
    if gateways > 1:
        rest = [start_one(f"gateway-{i}", port) for i in range(1, gateways)]
        launcher.wait_all(rest, timeout(), "healthy")
    state["gateway"] = {"host": host, "port": port, "url": url}
    launcher.save()
    more = f" ({gateways} gateways sharing the port)" if shared else ""
    progress(f"gateway healthy at {url}{more} ({launcher.elapsed():.1f}s)")
    nodes = (state.get("ray") or {}).get("gateway_nodes") or []
    if nodes:
        from areal_cli.cluster.ray_gateways import start_remote_gateways

        start_remote_gateways(
            launcher,
            nodes,
            gateway_bin=gateway_bin,
            port=port,
            args=[*common_args, *gateway_args],
            router_address=address,
            admin_api_key=admin_api_key,
            timeout=timeout(),
        )


def start_watchdog(launcher: Launcher) -> None:
    """`--detach` with supervision: the watchdog as a recorded component of the service."""
    argv = [sys.executable, "-m", "areal_cli.watchdog", "--group", launcher.group]
    argv += ["--service", launcher.service, "--instance", launcher.state["instance"]]
    proc, comp = launcher.spawn("watchdog", "watchdog", argv, env={})
    launcher.wait_all([(proc, comp, lambda: True)], 5.0)


def fail_launch(
    launcher: Launcher,
    e: BaseException,
    what: str,
    forget: Callable[[], None],
) -> NoReturn:
    """Stop everything `what` (run, register) started, `forget` it in the state, raise why."""
    # A second Ctrl-C must not cut the cleanup short and leave processes behind.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if launcher.started:
            progress(f"{what} failed: stopping {len(launcher.started)} started component(s)")
        launcher.abort()
        forget()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if isinstance(e, LaunchError):
        raise CLIError(str(e)) from None
    if isinstance(e, KeyboardInterrupt | Interrupted):
        raise CLIError(f"{what} interrupted; everything it started was stopped", code=130) from None
    raise e from None
