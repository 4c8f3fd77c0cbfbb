"""`--scheduler ray`: place units (replicas, agent pairs) on a Ray cluster and manage them.

What runs where (docs/cluster.md): the CLI runs on a node of the cluster (a Ray driver
needs the node's raylet); the gateway and router run beside it as local processes, as with
`local`; every unit is one placement-group bundle (its devices, packed on one node) with a
detached `UnitHost` actor in it that runs the unit's processes there. The bundles of a
model spread across nodes (`SPREAD`).

Service state records each unit's processes as components like local ones, with `pid` 0
(nothing local to signal) and `meta.actor` naming their host; `refresh()` fills in what
only the cluster knows (alive, node, remote pid, restarts) each time a command reads the
state. Importing this module imports Ray; nothing on a `local` path does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from areal_cli.errors import CLIError

NAMESPACE = "areal"
INSTALL_HINT = "pip install 'areal-cli[ray]'"
INFO_TIMEOUT = 5.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise CLIError(
            f"--scheduler ray needs Ray, which is not installed: {INSTALL_HINT}", code=2
        ) from None
    return ray


def connect(address: str) -> Any:
    """The `ray` module, connected to the cluster at `address` ("auto": the local one)."""
    if address.startswith("ray://"):
        raise CLIError(
            f"a Ray Client address ('{address}') is not supported: run areal on a node of the "
            "cluster and give the cluster's HOST:PORT (or 'auto')",
            code=2,
        )
    ray = import_ray()
    if ray.is_initialized():
        return ray
    try:
        ray.init(
            address=address or "auto",
            namespace=NAMESPACE,
            logging_level="ERROR",
            log_to_driver=False,
            include_dashboard=False,
        )
    except Exception as e:  # ConnectionError, ValueError: Ray's own, all one message here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CLIError(
            f"cannot connect to the Ray cluster at '{address or 'auto'}': {first}; start one "
            "with `ray start --head` on this node (or join this node to it) and pass its "
            "address with --ray-address or [scheduler] address"
        ) from None
    return ray


def device_resource(ray: Any, configured: str | None) -> str:
    """The Ray resource one device of a backend spec reserves: [scheduler] device_resource,
    else GPU where the cluster has GPUs, else CPU."""
    if configured:
        return configured
    return "GPU" if float(ray.cluster_resources().get("GPU", 0)) > 0 else "CPU"


def actor_name(group: str, service: str, unit: str) -> str:
    return f"areal-{group}-{service}-{unit}"


def pg_name(group: str, service: str, what: str) -> str:
    return f"areal-{group}-{service}-{what}"


# ---------------------------------------------------------------- placement


def place(ray: Any, name: str, count: int, per_unit: int, resource: str, timeout: float) -> Any:
    """A placement group of `count` bundles of `per_unit` `resource`, spread across nodes;
    a CLIError naming what is missing when the cluster cannot hold it (nothing left)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    need = count * per_unit
    total = float(ray.cluster_resources().get(resource, 0))
    largest = max(
        (float(n.get("Resources", {}).get(resource, 0)) for n in ray.nodes() if n.get("Alive")),
        default=0.0,
    )
    if total < need or largest < per_unit:
        raise CLIError(
            f"cannot place {count} unit(s) of {per_unit} {resource} each: the cluster has "
            f"{total:g} {resource} in all, {largest:g} on its largest node; add nodes, ask "
            "for fewer or smaller replicas, or set [scheduler] device_resource"
        )
    bundles = [{resource: float(per_unit)} for _ in range(count)]
    pg = placement_group(bundles, strategy="SPREAD", name=name, lifetime="detached")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except Exception:
        remove_placement_group(pg)
        free = float(ray.available_resources().get(resource, 0))
        raise CLIError(
            f"cannot place {count} unit(s) of {per_unit} {resource} each within {timeout:g}s: "
            f"{free:g} {resource} free now (other work holds the rest); free resources or "
            "ask for fewer replicas"
        ) from None
    return pg


def service_tls(group: str, service: str) -> dict[str, str]:
    """The service's CA, certificate and key (PEM) from its 0600 secrets, for its hosts."""
    from areal_cli import state as st

    secrets = st.load_secrets(group, service)
    return {k: secrets[f"tls_{k}"] for k in ("ca_cert", "cert", "key") if f"tls_{k}" in secrets}


def unit_doc(
    launcher: Any,
    name: str,
    tls: dict[str, str],
    needs: list[tuple[str, str]],
    processes: list[dict[str, Any]],
) -> dict[str, Any]:
    """What a host is given (host.UnitHost): what every unit of the service shares (its
    folders, shared_dir, TLS and [supervision] policy), and this unit's needs and processes."""
    from areal_cli import state as st

    return {
        "group": launcher.group,
        "service": launcher.service,
        "name": name,
        "base_dir": str(st.group_dir(launcher.group) / "ray"),
        "shared_dir": launcher.state["ray"].get("shared_dir") or "",
        # OpenTelemetry's standard configuration reaches every unit's processes, as a local
        # service's inherit it (docs/services.md, "Tracing"); OTEL_*HEADERS may hold a
        # collector's credentials and stays on the machine it was set on.
        "env": {
            k: v for k, v in os.environ.items() if k.startswith("OTEL_") and "HEADERS" not in k
        },
        "tls": tls,
        "supervision": launcher.state.get("supervision") or {},
        "needs": needs,
        "processes": processes,
    }


def start_unit(
    ray: Any, pg: Any, index: int, name: str, unit: dict[str, Any], resource: str, per_unit: int
) -> Any:
    """The detached host actor of one unit in bundle `index` of `pg` (it starts at once)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from areal_cli.cluster.host import UnitHost

    opts: dict[str, Any] = {
        "name": name,
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "max_restarts": -1,
        "max_concurrency": 8,  # info() and read_log() answer while the host's thread works
        "num_cpus": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        ),
    }
    # The host claims its bundle's devices: Ray then sets CUDA_VISIBLE_DEVICES for it
    # (inherited by the engine) and keeps other work off them.
    if resource == "CPU":
        opts["num_cpus"] = per_unit
    elif resource == "GPU":
        opts["num_gpus"] = per_unit
    else:
        opts["resources"] = {resource: per_unit}
    return ray.remote(UnitHost).options(**opts).remote({**unit, "actor": name})


def start_on_node(ray: Any, name: str, unit: dict[str, Any], node_ip: str) -> Any:
    """The detached host actor of a unit that needs no device, pinned to the node at
    `node_ip` (a gateway: clients know it by that address). Pinned by Ray's `node:<ip>`
    resource rather than by node id, so that a lost node's host, which Ray keeps trying to
    place again, comes back when a node with that address joins again."""
    from areal_cli.cluster.host import UnitHost

    return (
        ray.remote(UnitHost)
        .options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=-1,
            max_concurrency=8,
            num_cpus=0,
            resources={f"node:{node_ip}": NODE_SHARE},
        )
        .remote({**unit, "actor": name})
    )


# The share of a node's `node:<ip>` resource (1.0 per node) a pinned host claims: any
# number of them fit on their node.
NODE_SHARE = 0.001


def alive_node_ips(ray: Any) -> set[str]:
    return {str(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")}


def wait_units(ray: Any, actors: dict[str, Any], timeout: float) -> dict[str, dict[str, Any]]:
    """Every unit's info once all are ready; a CLIError with the first failure's reason."""
    deadline = time.monotonic() + timeout
    infos: dict[str, dict[str, Any]] = {}
    pending = dict(actors)
    while pending:
        for name, actor in list(pending.items()):
            try:
                info = ray.get(actor.info.remote(), timeout=INFO_TIMEOUT)
            except Exception as e:
                if _is_dead(ray, e):
                    raise CLIError(f"the host of {name} died: {e}") from None
                continue  # still being created
            if info["phase"] == "failed":
                raise CLIError(f"{name} failed to start: {info['error']}")
            if info["phase"] == "ready":
                infos[name] = info
                del pending[name]
        if pending and time.monotonic() > deadline:
            raise CLIError(f"{', '.join(pending)} not ready after {timeout:g}s")
        if pending:
            time.sleep(0.5)
    return infos


def _is_dead(ray: Any, e: Exception) -> bool:
    return isinstance(e, ray.exceptions.RayActorError) and not isinstance(
        e, getattr(ray.exceptions, "ActorUnavailableError", ())
    )


# ---------------------------------------------------------------- reading


def get_actor(ray: Any, name: str) -> Any | None:
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def unit_infos(ray: Any, names: Iterable[str]) -> dict[str, dict[str, Any] | None]:
    """Each host's info asked of the host itself (a driver's call), None for a host that is
    gone or not answering (being placed again)."""
    refs = {}
    for n in set(names):
        actor = get_actor(ray, n)
        if actor is not None:
            refs[n] = actor.info.remote()
    out: dict[str, dict[str, Any] | None] = {n: None for n in names}
    for n, ref in refs.items():
        try:
            out[n] = ray.get(ref, timeout=INFO_TIMEOUT)
        except Exception:
            out[n] = None
    return out


def published_infos(gcs: str, names: Iterable[str]) -> dict[str, dict[str, Any] | None]:
    """Each host's info as it last published it to the GCS (host.PUBLISH_INTERVAL), read
    with a plain GCS client: no `ray.init`, so the reader (`status`, the watchdog) runs no
    Ray core worker and opens no listening socket. None for a host that has published
    nothing yet or whose node is dead (it is being placed again, or gone)."""
    import json

    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled; 2.60 has it

    from areal_cli.cluster.host import KV_NAMESPACE

    names = list(names)
    try:
        client = GcsClient(address=gcs)
        values = client.internal_kv_multi_get(
            [n.encode() for n in names], KV_NAMESPACE.encode(), timeout=INFO_TIMEOUT
        )
        alive = {
            node_id.hex()
            for node_id, node in client.get_all_node_info(timeout=INFO_TIMEOUT).items()
            if node.state == 0
        }
    except Exception as e:
        raise CLIError(f"cannot read the Ray cluster's state at {gcs}: {e}") from None
    out: dict[str, dict[str, Any] | None] = {}
    for n in names:
        raw = values.get(n.encode())
        info: dict[str, Any] | None = json.loads(raw) if raw else None
        # A copy from a dead node is a host being placed again (or gone). Its age is not
        # compared: the nodes' clocks need not agree with this one.
        out[n] = info if info is not None and info["node_id"] in alive else None
    return out


def refresh(state: dict[str, Any]) -> None:
    """Fill each remote component's meta with what its host says now (in memory only)."""
    comps = state.get("components") or {}
    remote = {n: d for n, d in comps.items() if (d.get("meta") or {}).get("actor")}
    if not remote:
        return
    names = [d["meta"]["actor"] for d in remote.values()]
    sched = state.get("ray") or {}
    if sched.get("gcs_address"):
        infos = published_infos(sched["gcs_address"], names)
    else:  # a state pinned before hosts published their info
        infos = unit_infos(connect(sched.get("ray_address", "")), names)
    for d in remote.values():
        meta = d["meta"]
        info = infos.get(meta["actor"])
        proc = (info or {}).get("processes", {}).get(meta.get("unit_process", ""))
        if info is None or proc is None:
            meta["live"] = False
            sup = dict(meta.get("supervision") or {})
            sup["state"] = "restarting" if info is None and meta.get("placed") else "starting"
            meta["supervision"] = sup
            continue
        meta["live"] = bool(proc["alive"])
        meta["node"] = info["node_ip"]
        meta["remote_pid"] = proc["pid"]
        moves = int(meta.get("moves", 0))
        if meta.get("node_id") and info["node_id"] != meta["node_id"]:
            moves += 1
        meta["supervision"] = {
            "state": "failed" if proc["state"] == "failed" else proc["state"],
            "restarts": int(proc["restarts"]),
            "last_failure": proc.get("last_failure"),
            "moves": moves,
        }
        if proc.get("address"):
            meta["live_address"] = proc["address"]


# ---------------------------------------------------------------- logs


def read_log(state: dict[str, Any], comp: dict[str, Any], offset: int) -> tuple[bytes, int]:
    meta = comp["meta"]
    ray = connect((state.get("ray") or {}).get("ray_address", ""))
    actor = get_actor(ray, meta["actor"])
    if actor is None:
        raise CLIError(
            f"the host of {comp['name']} is gone; its log was on node {meta.get('node')}"
        )
    try:
        data, new, _size = ray.get(
            actor.read_log.remote(meta["unit_process"], offset), timeout=INFO_TIMEOUT * 2
        )
    except Exception as e:
        raise CLIError(f"cannot read the log of {comp['name']} from its node: {e}") from None
    return data, new


# ---------------------------------------------------------------- stopping


def stop_remote(comps: list[Any], *, grace: float, force: bool) -> list[str]:
    """Stop the unit hosts of these remote components (their processes first), kill the
    actors and remove their placement groups; the names of components still running."""
    by_address: dict[str, dict[str, set[str]]] = {}
    for c in comps:
        m = c.meta
        d = by_address.setdefault(m.get("ray_address", "auto"), {"actors": set(), "pgs": set()})
        d["actors"].add(m["actor"])
        if m.get("placement_group"):
            d["pgs"].add(m["placement_group"])
    left: set[str] = set()
    for address, d in by_address.items():
        ray = connect(address)
        left |= set(stop_actors(ray, d["actors"], grace=grace, force=force))
        remove_groups(ray, names=d["pgs"])
    return [c.name for c in comps if c.meta["actor"] in left]


def stop_actors(ray: Any, names: Iterable[str], *, grace: float, force: bool) -> list[str]:
    """Stop and kill the named hosts; the names Ray still lists afterwards."""
    actors = {n: a for n in names if (a := get_actor(ray, n)) is not None}
    # A host whose node is gone waits for Ray to place it again (a pinned gateway, until a
    # node with its address joins): nothing of it runs to stop, and asking would only wait.
    lost = _on_lost_nodes(ray, actors)
    refs = {
        n: a.stop.remote(0.0 if force else grace, force) for n, a in actors.items() if n not in lost
    }
    for ref in refs.values():
        try:
            ray.get(ref, timeout=(5 if force else grace) + 15)
        except Exception:
            pass  # killed below either way
    from ray.experimental.internal_kv import _internal_kv_del

    from areal_cli.cluster.host import KV_NAMESPACE

    for n, a in actors.items():
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass
        _internal_kv_del(n, namespace=KV_NAMESPACE)
    deadline = time.monotonic() + 15
    left = list(actors)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [n for n in left if get_actor(ray, n) is not None]
    return left


def _on_lost_nodes(ray: Any, names: Iterable[str]) -> set[str]:
    """The hosts whose last published info names a node Ray no longer counts alive."""
    import json

    from ray.experimental.internal_kv import _internal_kv_get

    from areal_cli.cluster.host import KV_NAMESPACE

    alive = {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}
    lost = set()
    for n in names:
        try:
            raw = _internal_kv_get(n, namespace=KV_NAMESPACE)
            node_id = json.loads(raw)["node_id"] if raw else ""
        except Exception:
            continue  # unknown: asked to stop like any other
        if node_id and node_id not in alive:
            lost.add(n)
    return lost


def sweep(address: str, group: str, service: str, *, grace: float, force: bool) -> list[str]:
    """Everything the cluster still runs under this service's name (what a launch killed
    midway did not record): hosts stopped, placement groups removed; the hosts left."""
    ray = connect(address)
    prefix = f"areal-{group}-{service}-"
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix)
    ]
    left = stop_actors(ray, names, grace=grace, force=force)
    remove_groups(ray, prefix=prefix)
    return left


def remove_groups(ray: Any, *, names: Iterable[str] = (), prefix: str = "") -> None:
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    wanted = set(names)
    for pg_id, info in ray.util.placement_group_table().items():
        name = str(info.get("name", ""))
        ours = name in wanted or (prefix and name.startswith(prefix))
        if ours and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def setup_tls(launcher: Any) -> None:
    """A CA and certificate for this service's internal gRPC: kept in its 0600 secrets (for
    units started later and for the watchdog), written as 0600 files for the local gateway
    and router, named in their environment (paths only)."""
    from areal_cli import state as st
    from areal_cli.tls import make_service_pki, write_pki

    pki = make_service_pki()
    secrets = st.load_secrets(launcher.group, launcher.service)
    secrets.update({f"tls_{k}": v for k, v in pki.items()})
    st.save_secrets(launcher.group, launcher.service, secrets)
    tls_dir = st.run_dir(launcher.group, launcher.service) / "tls"
    launcher.env.update(write_pki(tls_dir, pki))


def scheduler_settings(cfg: Any, address_flag: str | None) -> dict[str, Any]:
    """[scheduler] for ray, flags first; what is pinned into the service state."""
    address = address_flag or cfg.get("scheduler", "address") or os.environ.get("RAY_ADDRESS", "")
    return {
        "ray_address": address or "auto",
        "device_resource": cfg.get("scheduler", "device_resource") or "",
        "shared_dir": cfg.get("scheduler", "shared_dir") or "",
        "gateway_nodes": gateway_nodes(cfg),
    }


def gateway_nodes(cfg: Any) -> list[str]:
    """[scheduler] gateway_nodes: node addresses, each one given once."""
    given = cfg.get("scheduler", "gateway_nodes") or []
    if not all(isinstance(n, str) and n.strip() for n in given):
        raise CLIError(
            f"[scheduler] gateway_nodes must be a list of node addresses (got {given!r}); "
            'for example gateway_nodes = ["10.0.0.12"]',
            code=2,
        )
    nodes = [n.strip() for n in given]
    dup = sorted({n for n in nodes if nodes.count(n) > 1})
    if dup:
        raise CLIError(
            f"[scheduler] gateway_nodes names {', '.join(dup)} more than once: one gateway "
            "per node there (more on the CLI's node: --gateways)",
            code=2,
        )
    return nodes


def check_gateway_nodes(ray: Any, settings: dict[str, Any]) -> None:
    """Each of [scheduler] gateway_nodes is a live node of the cluster other than the CLI's
    (whose gateways are --gateways)."""
    nodes = settings.get("gateway_nodes") or []
    if not nodes:
        return
    alive = alive_node_ips(ray)
    here = settings.get("driver_node", "")
    if here in nodes:
        raise CLIError(
            f"[scheduler] gateway_nodes names this node ({here}), where the service's "
            "gateways already run: use --gateways N (or [launch] gateways) for more here",
            code=2,
        )
    unknown = [n for n in nodes if n not in alive]
    if unknown:
        raise CLIError(
            f"[scheduler] gateway_nodes: {', '.join(unknown)} is not a live node of the Ray "
            f"cluster (its nodes: {', '.join(sorted(alive))})",
            code=2,
        )
