"""A real multi-node Ray cluster on one machine, one network + pid namespace per node.

The recipe was measured on these machines (docs/cluster.md has how the tests use it); its rules:

- a bridge in the root namespace at 198.18.0.1/24 (no uplink, no default route anywhere);
- node ``i`` (1-based) is a network namespace with a veth on the bridge at 198.18.0.(10+i);
- each node's Ray runs under ``unshare --pid --fork --kill-child --mount-proc`` so the node
  has its own process table and ``kill -9`` of that ``unshare`` process kills the whole node
  (and ``ray stop`` inside a node would only see that node's processes: never run it outside);
- node 1 runs the Ray head, the others join it as workers;
- teardown kills only what was started here (by pid), deletes only the namespaces and the
  bridge made here and removes only the temp dirs made here.

The 198.18.0.0/24 addresses are fixed, so two clusters on one machine would fight over the
root namespace's route to that subnet: a machine-wide lock file serialises clusters (a second
one waits for the first to close, up to ``lock_timeout``).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.18.0"
BRIDGE_IP = f"{SUBNET}.1"
LOCK_PATH = Path(tempfile.gettempdir()) / "areal-netns-cluster-198.18.0.lock"

# GCS health checks of the raylets: a node whose raylet stops answering is marked dead after
# about initial_delay + period * threshold (+ timeout): ~3-4 s with these values (Ray's
# defaults, 3000 ms x 5 with a 10 s timeout, take ~30 s).
FAST_HEALTH_CHECK_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}

# Runs in a node namespace: prints the GCS's node table as JSON, without ray.init (fast).
_NODES_SCRIPT = """
import json, sys
from ray._raylet import GcsClient
c = GcsClient(address=sys.argv[1])
out = []
for node_id, info in c.get_all_node_info(timeout=10).items():
    out.append({"node_id": node_id.hex(), "ip": info.node_manager_address,
                "alive": info.state == 0, "resources": dict(info.resources_total)})
print(json.dumps(out))
"""


def ray_executable() -> str:
    """The `ray` script of the running interpreter's environment."""
    ray = Path(sys.executable).with_name("ray")
    if not ray.exists():
        raise FileNotFoundError(f"no ray executable next to {sys.executable}")
    return str(ray)


def missing_requirements() -> str | None:
    """Why a netns cluster cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network and pid namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command"
    try:
        ray_executable()
    except FileNotFoundError as e:
        return str(e)
    return None


@dataclass
class _Node:
    index: int
    ns: str
    ip: str
    veth_root: str
    veth_ns: str
    temp_dir: Path | None = None
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    pid_ns: str | None = None  # the readlink of /proc/<pid>/ns/pid of the node's processes
    killed: bool = False
    starts: int = 0


@dataclass
class NetnsCluster:
    """N namespaces on a bridge, a Ray head in node 1 and a Ray worker in each other node.

    ``resources`` maps a node index (1-based) to that node's custom Ray resources.
    """

    num_nodes: int = 2
    num_cpus: int = 2
    resources: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    object_store_memory: int = 100 * 1024 * 1024
    extra_env: Mapping[str, str] = field(default_factory=dict)
    fast_health_check: bool = True
    lock_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.num_nodes <= 200:
            raise ValueError("num_nodes must be 1..200")
        pid = os.getpid()
        self.tag = f"{pid}"
        self.port = 20000 + pid % 20000
        self.bridge = f"brar{pid}"
        self.nodes = [
            _Node(
                index=i,
                ns=f"arealc{pid}-{i}",
                ip=f"{SUBNET}.{10 + i}",
                veth_root=f"va{pid}n{i}",
                veth_ns=f"vb{pid}n{i}",
            )
            for i in range(1, self.num_nodes + 1)
        ]
        self.base_dir: Path | None = None
        self._lock_fd: int | None = None
        self._bridge_made = False
        self._ns_made: list[str] = []
        self._veths_made: list[str] = []
        self._closed = False
        self.timings: dict[str, float] = {}

    # ---- addresses and environment -------------------------------------------------------

    @property
    def head_ip(self) -> str:
        return self.nodes[0].ip

    @property
    def address(self) -> str:
        """The head's GCS address, ``198.18.0.11:<port>``."""
        return f"{self.head_ip}:{self.port}"

    def node(self, i: int) -> _Node:
        if not 1 <= i <= self.num_nodes:
            raise IndexError(f"node {i} not in 1..{self.num_nodes}")
        return self.nodes[i - 1]

    def ip(self, i: int) -> str:
        return self.node(i).ip

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for Ray processes (nodes and drivers) of this cluster."""
        env = dict(os.environ)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        if self.fast_health_check:
            env.update(FAST_HEALTH_CHECK_ENV)
        env.update(self.extra_env)
        if extra:
            env.update(extra)
        return env

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 120.0) -> NetnsCluster:
        """Build the network, start the head, then the workers; wait until all are alive."""
        if self._closed:
            raise RuntimeError("cluster already closed")
        why = missing_requirements()
        if why:
            raise RuntimeError(f"cannot build a netns cluster: {why}")
        atexit.register(self.close)
        t0 = time.monotonic()
        try:
            self._lock()
            self.base_dir = Path(tempfile.mkdtemp(prefix=f"rc{self.tag}.", dir="/tmp"))
            self._build_network()
            self.timings["network_s"] = time.monotonic() - t0
            self._start_node(self.nodes[0])
            self.wait_nodes(1, timeout)
            self.timings["head_s"] = time.monotonic() - t0
            for node in self.nodes[1:]:
                self._start_node(node)
                self.timings[f"node{node.index}_launch_s"] = time.monotonic() - t0
            self.wait_nodes(self.num_nodes, timeout)
            self.timings["start_s"] = time.monotonic() - t0
        except BaseException:
            self.close()
            raise
        return self

    def _lock(self) -> None:
        fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(f"another netns cluster holds {LOCK_PATH}") from None
                time.sleep(0.5)
        self._lock_fd = fd

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

    def _build_network(self) -> None:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        self._ip("addr", "add", f"{BRIDGE_IP}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for node in self.nodes:
            self._ip("netns", "add", node.ns)
            self._ns_made.append(node.ns)
            self._ip("link", "add", node.veth_root, "type", "veth", "peer", "name", node.veth_ns)
            self._veths_made.append(node.veth_root)
            self._ip("link", "set", node.veth_ns, "netns", node.ns)
            self._ip("link", "set", node.veth_root, "master", self.bridge)
            self._ip("link", "set", node.veth_root, "up")
            self._ip("-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", node.veth_ns)
            self._ip("-n", node.ns, "link", "set", node.veth_ns, "up")
            self._ip("-n", node.ns, "link", "set", "lo", "up")

    def start_node(self, i: int, timeout: float = 120.0) -> None:
        """Restart worker node i's Ray after kill_node(i); wait until the head sees it alive.

        (Not node 1: a new head would be a new cluster, which the other nodes do not join.)
        """
        node = self.node(i)
        if i == 1:
            raise ValueError("restarting the head node is not supported")
        if self._closed or self.base_dir is None:
            raise RuntimeError("cluster not started or already closed")
        if node.proc is not None and node.proc.poll() is None:
            raise RuntimeError(f"node {i} is running")
        self._start_node(node)
        deadline = time.monotonic() + timeout
        while node.ip not in self.alive_ips():
            if node.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {i} did not rejoin:\n{self.log(i)[-4000:]}")
            time.sleep(0.5)

    def _start_node(self, node: _Node) -> None:
        assert self.base_dir is not None
        node.starts += 1
        node.killed = False
        # Short: Ray's unix socket paths (temp_dir/session_<date>_<pid>/sockets/...) are limited.
        node.temp_dir = self.base_dir / f"n{node.index}.{node.starts}"
        node.temp_dir.mkdir()
        node.log_path = self.base_dir / f"node{node.index}.{node.starts}.log"
        argv = [ray_executable(), "start", "--block"]
        if node.index == 1:
            argv += ["--head", "--port", str(self.port), "--include-dashboard=false"]
        else:
            argv += ["--address", self.address]
        argv += [
            "--node-ip-address",
            node.ip,
            "--num-cpus",
            str(self.num_cpus),
            "--num-gpus",
            "0",
            "--object-store-memory",
            str(self.object_store_memory),
            "--temp-dir",
            str(node.temp_dir),
            "--disable-usage-stats",
        ]
        res = self.resources.get(node.index)
        if res:
            argv += ["--resources", json.dumps(dict(res))]
        unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
        with open(node.log_path, "wb") as log:
            # `ip netns exec` execs its command, so proc.pid is the unshare process.
            node.proc = subprocess.Popen(
                ["ip", "netns", "exec", node.ns, *unshare, *argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )
        node.pid_ns = self._read_pid_ns(node)

    def _read_pid_ns(self, node: _Node, timeout: float = 10.0) -> str:
        """The pid namespace of the node's processes: unshare's pid_for_children once forked."""
        assert node.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise RuntimeError(f"node {node.index} exited at once:\n{self.log(node.index)}")
            try:
                comm = Path(f"/proc/{node.proc.pid}/comm").read_text().strip()
                mine = os.readlink(f"/proc/{node.proc.pid}/ns/pid")
                child = os.readlink(f"/proc/{node.proc.pid}/ns/pid_for_children")
            except OSError:
                comm, mine, child = "", "", ""
            if comm == "unshare" and child and child != mine:
                return child
            time.sleep(0.05)
        raise RuntimeError(f"node {node.index}: unshare did not make a pid namespace")

    def log(self, i: int) -> str:
        path = self.node(i).log_path
        return path.read_text(errors="replace") if path and path.exists() else ""

    # ---- queries --------------------------------------------------------------------------

    def init_pid(self, i: int) -> int:
        """The root-namespace pid of node i's init (pid 1 of its pid namespace)."""
        node = self.node(i)
        if node.proc is None or node.proc.poll() is not None:
            raise RuntimeError(f"node {i} is not running")
        pid = node.proc.pid
        return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])

    def exec_argv(self, i: int, argv: Sequence[str], pid_ns: bool = True) -> list[str]:
        """The argv that runs ``argv`` on node i.

        With ``pid_ns`` (the default) the process enters node i's network, mount (its /proc)
        and pid namespaces through ``nsenter``: it sees only that node's processes, so a Ray
        driver attaches to node i's raylet, and it dies with the node. ``nsenter`` forks the
        command into the pid namespace: to stop it, signal the process group (start it with
        ``start_new_session=True``), not only the nsenter pid.

        Without ``pid_ns`` it is ``ip netns exec``: node i's network only, the caller's pid
        namespace. A Ray driver started that way sees every node's raylet in ``ps`` and
        attaches to the head's (Ray prefers the head among "local" raylets), advertising the
        head's address: right on node 1, broken on other nodes (see the module docstring).
        """
        if pid_ns:
            pid = self.init_pid(i)
            return ["nsenter", "-t", str(pid), "-n", "-m", "-p", "--", *argv]
        return ["ip", "netns", "exec", self.node(i).ns, *argv]

    def run(
        self,
        i: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        check: bool = True,
        pid_ns: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on node i (see exec_argv) with this cluster's Ray environment; on
        timeout the whole process group is killed."""
        cmd = self.exec_argv(i, argv, pid_ns=pid_ns)
        proc = subprocess.Popen(
            cmd,
            env=self.env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def nodes_info(self, timeout: float = 30.0) -> list[dict]:
        """The GCS's node table: dicts with node_id, ip, alive, resources."""
        out = self.run(
            1, [sys.executable, "-c", _NODES_SCRIPT, self.address], timeout=timeout, pid_ns=False
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def alive_ips(self) -> set[str]:
        return {n["ip"] for n in self.nodes_info() if n["alive"]}

    def wait_nodes(self, n: int, timeout: float = 120.0) -> list[dict]:
        """Wait until the first n nodes are alive in the GCS; returns the node table."""
        want = {node.ip for node in self.nodes[:n]}
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            for node in self.nodes[:n]:
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(
                        f"node {node.index} exited ({node.proc.returncode}):\n"
                        f"{self.log(node.index)[-4000:]}"
                    )
            try:
                info = self.nodes_info(timeout=max(5.0, min(30.0, deadline - time.monotonic())))
                if want <= {x["ip"] for x in info if x["alive"]}:
                    return info
                last = info
            except (subprocess.SubprocessError, ValueError, IndexError) as e:
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(want)} not all alive after {timeout}s: {last}")
            time.sleep(0.5)

    def wait_node_dead(self, i: int, timeout: float = 60.0) -> float:
        """Wait until the GCS marks node i dead; returns the seconds waited."""
        ip = self.ip(i)
        t0 = time.monotonic()
        while ip in self.alive_ips():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"node {i} still alive in the GCS after {timeout}s")
            time.sleep(0.25)
        return time.monotonic() - t0

    def pids_in_node(self, i: int) -> list[int]:
        """Pids of processes in node i's pid namespace (empty once the node is dead)."""
        ns = self.node(i).pid_ns
        if ns is None:
            return []
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        pids.append(int(entry))
                except OSError:
                    pass
        return pids

    # ---- faults and teardown --------------------------------------------------------------

    def kill_node(self, i: int, timeout: float = 15.0) -> None:
        """Kill node i as a machine dies: SIGKILL of its unshare process (--kill-child then
        SIGKILLs the namespace's init, and with it every process of the node). Returns once no
        process of the node's pid namespace is left."""
        node = self.node(i)
        if node.proc is not None and node.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=timeout)
        node.killed = True
        deadline = time.monotonic() + timeout
        while left := self.pids_in_node(i):
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {i}: pids {left} left after kill")
            time.sleep(0.05)

    def close(self) -> None:
        """Tear down everything this cluster made, in order; idempotent."""
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        errors: list[str] = []
        # Workers first, then the head (so nothing is left trying to reach a dead head).
        for node in reversed(self.nodes):
            try:
                self.kill_node(node.index)
            except Exception as e:  # keep tearing down
                errors.append(f"kill node {node.index}: {e}")
        for ns in self._ns_made:
            try:
                self._ip("netns", "del", ns)
            except subprocess.CalledProcessError as e:
                errors.append(f"netns del {ns}: {e.stderr.strip()}")
        # The root ends of the veths die with their peers; delete any that did not.
        for veth in self._veths_made:
            if Path(f"/sys/class/net/{veth}").exists():
                with contextlib.suppress(subprocess.CalledProcessError):
                    self._ip("link", "del", veth)
        if self._bridge_made:
            try:
                self._ip("link", "del", self.bridge)
            except subprocess.CalledProcessError as e:
                errors.append(f"link del {self.bridge}: {e.stderr.strip()}")
        if self.base_dir is not None and not os.environ.get("AREAL_TEST_KEEP_CLUSTER_LOGS"):
            shutil.rmtree(self.base_dir, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        self.timings["close_s"] = time.monotonic() - t0
        if errors:
            raise RuntimeError("netns cluster teardown: " + "; ".join(errors))
