"""Start a real inference stack (router, gateway, proxies) in front of an engine.

Everything goes through areal_cli.supervisor, the code the `areal` CLI uses to
spawn, wait for and stop components. The engine is the session fixture's, so
one engine serves many stacks; each stack has its own router and gateway.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from areal_cli import supervisor

ADMIN_KEY = "areal-admin-key"


@dataclass
class Proc:
    comp: supervisor.Component
    popen: subprocess.Popen
    info: dict

    @property
    def address(self) -> str:
        return f"{self.info['host']}:{self.info['port']}"


@dataclass
class Stack:
    gateway_url: str
    router: Proc
    gateway: Proc
    proxies: list[Proc] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = Path()

    def all(self) -> list[Proc]:
        return [*self.proxies, self.gateway, self.router]

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )

    def stop(self, grace: float = 5.0) -> None:
        tiers = [[p.comp for p in self.proxies], [self.gateway.comp], [self.router.comp]]
        supervisor.terminate(tiers, grace=grace, procs={p.popen.pid: p.popen for p in self.all()})
        left = [p.comp.name for p in self.all() if supervisor.group_alive(p.comp)]
        assert not left, f"left running after stop: {left}"


def launch(
    name: str, argv: list[str], log_dir: Path, env: dict[str, str], timeout: float = 60
) -> Proc:
    ready = log_dir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    popen, comp = supervisor.spawn(
        name, [*argv, "--ready-file", str(ready)], log_dir / f"{name}.log", env=env
    )

    def is_ready() -> bool:
        info = supervisor.read_ready_file(ready)
        return bool(info) and info.get("pid") == popen.pid

    try:
        supervisor.wait_ready(popen, comp, is_ready, timeout)
    except BaseException:
        supervisor.terminate([[comp]], grace=2, procs={popen.pid: popen})
        raise
    info = supervisor.read_ready_file(ready) or {}
    comp.host, comp.port = info["host"], info["port"]
    return Proc(comp, popen, info)


def proxy_argv(
    stack: Stack,
    engine_url: str,
    model: str,
    tokenizer: Path,
    rank: int,
    extra: list[str],
    port: int = 0,
) -> list[str]:
    name = f"{model}-data-proxy-{rank}"
    return [
        "areal-proxy",
        "--engine-url",
        engine_url,
        "--model",
        model,
        "--tokenizer-path",
        str(tokenizer),
        "--proxy-id",
        name,
        "--port",
        str(port),
        "--db-path",
        str(stack.log_dir / f"{name}.sqlite"),
        *extra,
    ]


def start_proxy(
    stack: Stack, engine_url: str, model: str, tokenizer: Path, rank: int, extra: list[str]
) -> Proc:
    argv = proxy_argv(stack, engine_url, model, tokenizer, rank, extra)
    return launch(f"{model}-data-proxy-{rank}", argv, stack.log_dir, stack.env)


def start_stack(
    log_dir: Path,
    engine_url: str,
    tokenizer: Path,
    *,
    model: str = "tiny-parrot",
    policy: str = "round_robin",
    n_proxies: int = 2,
    proxy_args: list[str] | None = None,
    gateway_args: list[str] | None = None,
    router_args: list[str] | None = None,
) -> Stack:
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
                policy,
                "--health-interval",
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
                "--port",
                "0",
                "--router-addr",
                router.address,
                *(gateway_args or []),
            ],
            log_dir,
            env,
        )
        started.append(gateway)
        stack = Stack(
            f"http://{gateway.info['host']}:{gateway.info['port']}",
            router,
            gateway,
            env=env,
            log_dir=log_dir,
        )
        for rank in range(n_proxies):
            stack.proxies.append(
                start_proxy(stack, engine_url, model, tokenizer, rank, proxy_args or [])
            )
            started.append(stack.proxies[-1])
        with stack.admin() as c:
            r = c.post(
                "/admin/models",
                json={
                    "name": model,
                    "kind": "internal",
                    "proxies": [
                        {"proxy_id": p.comp.name, "address": p.address} for p in stack.proxies
                    ],
                },
            )
            assert r.status_code == 201, r.text
        wait_healthy(stack, model, n_proxies)
        return stack
    except BaseException:
        supervisor.terminate(
            [[p.comp] for p in reversed(started)],
            grace=2,
            procs={p.popen.pid: p.popen for p in started},
        )
        raise


def workers(stack: Stack) -> list[dict]:
    with stack.admin() as c:
        r = c.get("/admin/workers")
        r.raise_for_status()
        return r.json()["workers"]


def wait_healthy(stack: Stack, model: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ws = [w for w in workers(stack) if w.get("model") == model]
        healthy = [
            w
            for w in ws
            if str(w.get("health", "")).upper().endswith("HEALTHY")
            and "UN" not in str(w.get("health", "")).upper()
        ]
        if len(healthy) >= n:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"proxies not healthy after {timeout}s: {json.dumps(ws)}")
        time.sleep(0.2)


def metric(proc: Proc, name: str) -> float:
    """Sum of a Prometheus metric's samples on a component's metrics port."""
    body = httpx.get(f"http://127.0.0.1:{proc.info['metrics_port']}/metrics", timeout=10).text
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head == name or head.startswith(name + "{"):
                total += float(value)
    return total
