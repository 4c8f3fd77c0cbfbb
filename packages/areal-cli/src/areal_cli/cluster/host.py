"""What runs on a cluster node for one placement unit: its processes, started and kept alive.

A unit is one replica (an engine and its data proxy) or one agent pair (a worker and its
proxy). The scheduler creates one `UnitHost` per unit as a detached Ray actor in the unit's
placement-group bundle; the host starts the unit's processes on its node with the same
`supervisor` code as `--scheduler local` (own process group each, output to a log file),
in order, each once the one before is ready.

Addresses exist only on the node, so a unit's process specs carry placeholders the host
fills in: `{node_ip}`, `{port:<name>}` (a free port on the node, chosen once so that a
restarted process keeps its address), `{run}`, `{logs}` and `{data}` (the host's folders).

Ray restarts a host whose worker process or node died (`max_restarts=-1`), inside its
bundle, which Ray places again on a live node: `__init__` then starts everything afresh
there, and `info()` reports the new node and addresses for the CLI's supervisor to
re-register. A process that dies under a live host is restarted by the host itself with a
backoff and a budget, like the local watchdog.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from areal_cli import supervisor
from areal_cli.private_files import make_dir, open_append
from areal_cli.state import write_private

# areal-proxy's `--lost-data` (areal_proxy.settings), through its environment.
LOST_DATA_ENV = "AREAL_PROXY_LOST_DATA"
_PLACEHOLDER = re.compile(r"\{(node_ip|run|logs|data|port:[a-z0-9_-]+)\}")
READY_POLL = 0.1
MONITOR_INTERVAL = 0.5
# The host's info() goes to Ray's GCS key-value store under its actor name this often, so
# that `status` and the watchdog read it without becoming Ray drivers (areal_cli.cluster.
# ray_scheduler.published_infos); a copy from a node Ray marked dead is a lost host.
PUBLISH_INTERVAL = 2.0
KV_NAMESPACE = "areal"
# A process that dies is restarted at most `max_restarts` times per `window` seconds, with a
# backoff: the service's [supervision] (areal_cli.watchdog.Policy), these when not given.
DEFAULT_POLICY = {
    "enabled": True,
    "max_restarts": 5,
    "window": 600.0,
    "backoff_initial": 0.5,
    "backoff_max": 30.0,
}


class UnitHost:
    """Starts, watches and stops one unit's processes on this node (a Ray actor's body)."""

    def __init__(self, unit: dict[str, Any]) -> None:
        import ray

        self.unit = unit
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.reconstructed = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        base = Path(unit["base_dir"]).expanduser() / unit["service"] / unit["name"]
        self.dirs = {"run": base / "run", "logs": base / "logs"}
        data = unit.get("shared_dir")
        # Without a shared directory a unit's data belongs to its node: a unit placed again on
        # another node starts empty (and says so), never on a copy it cannot have.
        self.dirs["data"] = (
            Path(data) / unit["group"] / unit["service"]
            if data
            else base / "data" / self.node_id[:12]
        )
        fresh = not self.dirs["data"].exists() or not any(self.dirs["data"].iterdir())
        for d in self.dirs.values():
            make_dir(d)
        self.env = dict(unit.get("env") or {})
        if self.reconstructed and not data and fresh:
            # Placed again on a node that never held this unit's data: its proxy says so for
            # every session it does not know (replica_data_lost), not a silent short export.
            self.env[LOST_DATA_ENV] = (
                f"unit {unit['name']} of service '{unit['service']}' was placed again on node "
                f"{self.node_ip} after its node was lost, and what it had recorded there is "
                "gone (set [scheduler] shared_dir to keep recorded data across node loss)"
            )
        self.env.update(self._write_tls(unit.get("tls") or {}))
        self.policy = {**DEFAULT_POLICY, **(unit.get("supervision") or {})}
        self.ports: dict[str, int] = {}
        self.phase = "starting"
        self.error = ""
        self.started_at = time.time()
        self.procs: dict[str, dict[str, Any]] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="unit-host", daemon=True)
        self._thread.start()
        self._publisher = threading.Thread(target=self._publish_loop, name="unit-info", daemon=True)
        self._publisher.start()

    # -- queries ---------------------------------------------------------
    def info(self) -> dict[str, Any]:
        with self._lock:
            procs = {}
            for name, p in self.procs.items():
                comp = p["comp"]
                procs[name] = {
                    "pid": comp.pid,
                    "alive": comp.alive(),
                    "restarts": p["restarts"],
                    "last_failure": p.get("last_failure"),
                    "log": comp.log,
                    "address": p.get("address", ""),
                    "port": p.get("port", 0),
                    "state": p.get("state", "running"),
                }
            return {
                "node_ip": self.node_ip,
                "node_id": self.node_id,
                "reconstructed": self.reconstructed,
                "phase": self.phase,
                "error": self.error,
                "started_at": self.started_at,
                "processes": procs,
            }

    def read_log(self, name: str, offset: int, limit: int = 1 << 20) -> tuple[bytes, int, int]:
        """(bytes from `offset`, the offset after them, the file's size); offset < 0: from the
        end. A log that shrank (replaced) reads from 0 again."""
        path = self.dirs["logs"] / f"{name}.log"
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset < 0:
                    offset = max(0, size + offset)
                elif offset > size:
                    offset = 0
                f.seek(offset)
                data = f.read(limit)
        except FileNotFoundError:
            return b"", 0, 0
        return data, offset + len(data), size

    def ready(self) -> bool:
        return True

    # -- stopping --------------------------------------------------------
    def stop(self, grace: float, force: bool = False) -> list[str]:
        """Stop every process (the last started first); the names of any that survived."""
        self._stopping.set()
        self._thread.join(timeout=5)
        with self._lock:
            comps = [p["comp"] for p in reversed(self.procs.values())]
            popens = {p["proc"].pid: p["proc"] for p in self.procs.values()}
        # With our Popen objects, so that what exits is reaped (no zombies in the actor).
        supervisor.terminate([[c] for c in comps], grace=grace, force=force, procs=popens)
        return [c.name for c in comps if supervisor.group_alive(c)]

    # -- the body --------------------------------------------------------
    def _run(self) -> None:
        try:
            self._check_needs()
            for spec in self.unit["processes"]:
                if self._stopping.is_set():
                    return
                self._start(spec, first=True)
            self.phase = "ready"
            self._publish()
        except Exception as e:  # reported through info(); the CLI fails the launch with it
            self.phase, self.error = "failed", str(e)
            self._publish()
            return
        self._monitor()

    def _start(self, spec: dict[str, Any], first: bool) -> None:
        name = spec["name"]
        argv = [self._fill(a) for a in spec["argv"]]
        env = {k: self._fill(v) for k, v in {**self.env, **(spec.get("env") or {})}.items()}
        log = self.dirs["logs"] / f"{name}.log"
        if spec.get("loopback_preload"):
            from areal_cli import loopback

            preload, why = loopback.shim()
            if preload:
                env = loopback.with_preload(env, preload)
            else:  # said where the operator looks: this component's log
                with open_append(log) as out:
                    out.write(
                        f"warning: {why}; the engine may listen on a wildcard address\n".encode()
                    )
        ready = spec.get("ready") or {}
        if ready.get("file"):
            with contextlib.suppress(FileNotFoundError):
                (self.dirs["run"] / f"{name}.ready").unlink()
        # The host's Ray worker may be killed outright (ray.kill, a crash): its processes go
        # with it rather than run on beside the host Ray starts again.
        proc, comp = supervisor.spawn(
            name, argv, log, env=env, cwd=spec.get("cwd"), die_with_parent=True
        )
        entry = self.procs.get(name) or {"restarts": 0, "history": []}
        entry.update(comp=comp, proc=proc, spec=spec, state="starting")
        with self._lock:
            self.procs[name] = entry
        deadline = time.monotonic() + float(spec.get("timeout", 600))
        while not self._is_ready(name, ready, proc.pid):
            if proc.poll() is not None:
                tail = supervisor.log_tail(log, 15)
                raise RuntimeError(
                    f"{name} exited (code {proc.returncode}) on node {self.node_ip}; "
                    f"log {log}:\n{tail}"
                )
            if time.monotonic() > deadline or self._stopping.is_set():
                raise RuntimeError(f"{name} not ready after {spec.get('timeout', 600)}s")
            time.sleep(READY_POLL)
        if "address_port" in spec:
            port = self.ports.get(spec["address_port"], 0)
            entry.update(port=port, address=f"{self.node_ip}:{port}")
        elif "address" in spec:  # a port chosen by the CLI (a gateway's: the service's)
            address = self._fill(spec["address"])
            entry.update(port=int(address.rsplit(":", 1)[1]), address=address)
        entry["state"] = "running"

    def _check_needs(self) -> None:
        """What the unit needs on this node, checked before any of it starts."""
        # Only paths: a tokenizer named by a hub id is the engine's business.
        missing = [
            f"{what} ({path})"
            for what, path in self.unit.get("needs") or []
            if os.path.isabs(path) and not os.path.exists(path)
        ]
        if missing:
            raise RuntimeError(
                f"node {self.node_ip} lacks {', '.join(missing)}: install or copy them to the "
                "same paths on every node (docs/cluster.md, 'What each node needs')"
            )

    def _is_ready(self, name: str, ready: dict[str, Any], pid: int) -> bool:
        if "http" in ready:
            return supervisor.http_ok(self._fill(ready["http"]), timeout=1.0)
        if ready.get("file"):
            info = supervisor.read_ready_file(self.dirs["run"] / f"{name}.ready")
            return bool(info and info.get("pid") == pid and info.get("port"))
        return True

    def _monitor(self) -> None:
        while not self._stopping.wait(MONITOR_INTERVAL):
            for entry in list(self.procs.values()):
                proc = entry["proc"]
                if entry["state"] in ("failed", "dead"):
                    continue  # out of restarts (or not supervised): stays down, says so
                if proc.poll() is None or self._stopping.is_set():
                    continue
                now = time.time()
                window = self.policy["window"]
                entry["history"] = [t for t in entry["history"] if now - t < window]
                entry["last_failure"] = {
                    "at": now,
                    "reason": f"exited with code {proc.returncode}",
                }
                pol = self.policy
                if not pol["enabled"] or len(entry["history"]) >= pol["max_restarts"]:
                    entry["state"] = "failed" if pol["enabled"] else "dead"
                    continue
                delay = min(pol["backoff_max"], pol["backoff_initial"] * 2 ** len(entry["history"]))
                entry["state"] = "restarting"
                if self._stopping.wait(delay):
                    return
                entry["history"].append(now)
                entry["restarts"] += 1
                # Whatever the dead leader left in its group goes before the new one starts.
                supervisor.terminate([[entry["comp"]]], grace=0, force=True)
                try:
                    self._start(entry["spec"], first=False)
                except Exception as e:
                    entry["last_failure"] = {"at": time.time(), "reason": str(e)[:500]}

    def _publish_loop(self) -> None:
        while not self._stopping.wait(PUBLISH_INTERVAL):
            self._publish()

    def _publish(self) -> None:
        key = self.unit.get("actor")
        if not key or self._stopping.is_set():
            return
        try:
            from ray.experimental.internal_kv import _internal_kv_put

            doc = {**self.info(), "published_at": time.time()}
            _internal_kv_put(key, json.dumps(doc), overwrite=True, namespace=KV_NAMESPACE)
        except Exception:  # the next round tries again; info() answers meanwhile
            pass

    # -- helpers ---------------------------------------------------------
    def _fill(self, value: str) -> str:
        def one(m: re.Match[str]) -> str:
            key = m.group(1)
            if key == "node_ip":
                return self.node_ip
            if key.startswith("port:"):
                name = key[5:]
                if name not in self.ports:
                    self.ports[name] = _free_port(self.node_ip, set(self.ports.values()))
                return str(self.ports[name])
            return str(self.dirs[key])

        return _PLACEHOLDER.sub(one, value)

    def _write_tls(self, tls: dict[str, str]) -> dict[str, str]:
        """The service's certificate and key as 0600 files on this node, named in the env."""
        if not tls:
            return {}
        d = self.dirs["run"] / "tls"
        make_dir(d)
        env = {}
        for key, var in (
            ("ca_cert", "AREAL_TLS_CA"),
            ("cert", "AREAL_TLS_CERT"),
            ("key", "AREAL_TLS_KEY"),
        ):
            path = d / f"{key}.pem"
            write_private(path, tls[key].encode())
            env[var] = str(path)
        return env


def _free_port(host: str, taken: set[int]) -> int:
    for _ in range(50):
        port = supervisor.free_port(host)
        if port not in taken:
            return port
    raise RuntimeError(f"no free port on {host}")
