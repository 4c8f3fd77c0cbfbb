"""Start a real agent stack: router, gateway `--mode agent`, N (worker, data proxy) pairs.

Mirrors tests/e2e/stack.py and spawns every binary through areal_cli.supervisor (the code
the `areal` CLI uses). Each pair's proxy joins the router through `POST /admin/pairs`, as the
CLI does. Workers get `PYTHONPATH=<repo root>` so that `--agent examples.agents.X` imports.

(Named agent_stack.py, not stack.py: test directories share one module namespace when the
suites run together, and tests/e2e already has a `stack` module.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import httpx

from areal_cli import supervisor

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "areal-agent-admin"
PARROT = ROOT / "models" / "tiny-parrot"


def _load_e2e_stack() -> ModuleType:
    """tests/e2e/stack.py under its own name (for the inference stack and `launch`)."""
    if "areal_e2e_stack" in sys.modules:
        return sys.modules["areal_e2e_stack"]
    spec = importlib.util.spec_from_file_location("areal_e2e_stack", ROOT / "tests/e2e/stack.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


e2e = _load_e2e_stack()
Proc = e2e.Proc
launch = e2e.launch


@dataclass
class Pair:
    index: int
    worker: Proc
    proxy: Proc

    @property
    def proxy_id(self) -> str:
        return f"proxy-{self.index}"


@dataclass
class AgentStack:
    gateway_url: str
    router: Proc
    gateway: Proc
    pairs: list[Pair] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = Path()

    def all(self) -> list[Proc]:
        return [
            *(p for pair in self.pairs for p in (pair.proxy, pair.worker)),
            self.gateway,
            self.router,
        ]

    def client(self, key: str = ADMIN_KEY, timeout: float = 60) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def async_client(self, key: str = ADMIN_KEY, timeout: float = 60) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.gateway_url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=200),
        )

    def kill_worker(self, index: int) -> None:
        """SIGKILL a pair's worker (its whole process group) and wait until it is gone."""
        comp = self.pairs[index].worker.comp
        os.killpg(comp.pgid, signal.SIGKILL)
        self.pairs[index].worker.popen.wait(10)
        deadline = time.monotonic() + 10
        while supervisor.group_alive(comp) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, grace: float = 5.0) -> None:
        tiers = [
            [p.proxy.comp for p in self.pairs],
            [p.worker.comp for p in self.pairs],
            [self.gateway.comp],
            [self.router.comp],
        ]
        supervisor.terminate(tiers, grace=grace, procs={p.popen.pid: p.popen for p in self.all()})
        left = [p.comp.name for p in self.all() if supervisor.group_alive(p.comp)]
        assert not left, f"left running after stop: {left}"


def start_pair(
    stack: AgentStack,
    index: int,
    agent: str,
    proxy_args: list[str],
    proxy_env: dict[str, str],
) -> Pair:
    # The repo root (examples.agents.*) and this folder (areal_test_agents).
    path = [str(ROOT), str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
    worker_env = {**stack.env, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    worker = launch(
        f"worker-{index}",
        ["areal-agent-worker", "--agent", agent, "--port", "0"],
        stack.log_dir,
        worker_env,
    )
    try:
        proxy = launch(
            f"proxy-{index}",
            [
                "areal-agent-proxy",
                "--worker-addr",
                f"{worker.info['host']}:{worker.info['port']}",
                "--proxy-id",
                f"proxy-{index}",
                "--port",
                "0",
                *proxy_args,
            ],
            stack.log_dir,
            {**stack.env, **proxy_env},
        )
    except BaseException:
        supervisor.terminate([[worker.comp]], grace=2, procs={worker.popen.pid: worker.popen})
        raise
    return Pair(index, worker, proxy)


def start_agent_stack(
    log_dir: Path,
    agent: str,
    *,
    n_pairs: int = 1,
    proxy_args: list[str] | None = None,
    proxy_env: dict[str, str] | None = None,
    router_args: list[str] | None = None,
    gateway_args: list[str] | None = None,
) -> AgentStack:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"AREAL_INTERNAL_TOKEN": secrets.token_hex(16), "AREAL_ADMIN_API_KEY": ADMIN_KEY}
    started: list[Proc] = []
    try:
        router = launch(
            "router",
            [
                "areal-router",
                "--port",
                "0",
                "--policy",
                "session_affinity",
                "--health-interval",
                "0.5",
                "--health-timeout",
                "0.5",
                *(router_args or []),
            ],
            log_dir,
            env,
        )
        started.append(router)
        gateway = launch(
            "gateway",
            [
                "areal-gateway",
                "--mode",
                "agent",
                "--port",
                "0",
                "--router-addr",
                f"{router.info['host']}:{router.info['port']}",
                *(gateway_args or []),
            ],
            log_dir,
            env,
        )
        started.append(gateway)
        stack = AgentStack(
            f"http://{gateway.info['host']}:{gateway.info['port']}",
            router,
            gateway,
            env=env,
            log_dir=log_dir,
        )
        for i in range(n_pairs):
            pair = start_pair(stack, i, agent, proxy_args or [], proxy_env or {})
            stack.pairs.append(pair)
            started += [pair.worker, pair.proxy]
        with stack.client() as c:
            for pair in stack.pairs:
                r = c.post(
                    "/admin/pairs",
                    json={
                        "proxy_id": pair.proxy_id,
                        "address": f"{pair.proxy.info['host']}:{pair.proxy.info['port']}",
                    },
                )
                assert r.status_code == 201, r.text
        wait_healthy(stack, n_pairs)
        return stack
    except BaseException:
        supervisor.terminate(
            [[p.comp] for p in reversed(started)],
            grace=2,
            procs={p.popen.pid: p.popen for p in started},
        )
        raise


def workers(stack: AgentStack) -> dict[str, dict]:
    with stack.client() as c:
        r = c.get("/admin/workers")
        r.raise_for_status()
        return {w["proxy_id"]: w for w in r.json()["workers"]}


def wait_healthy(stack: AgentStack, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ws = workers(stack)
        if sum(w["health"] == "healthy" for w in ws.values()) >= n:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pairs not healthy after {timeout}s: {json.dumps(ws)}")
        time.sleep(0.1)


def wait_health(stack: AgentStack, proxy_id: str, health: str, timeout: float = 15) -> float:
    """Seconds until `/admin/workers` shows `proxy_id` with `health`."""
    t0 = time.monotonic()
    while True:
        w = workers(stack).get(proxy_id, {})
        if w.get("health") == health:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{proxy_id} not {health} after {timeout}s: {w}")
        time.sleep(0.1)
