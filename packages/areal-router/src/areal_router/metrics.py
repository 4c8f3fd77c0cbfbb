"""Prometheus metrics of the router (served on --metrics-port at /metrics)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from areal_router.registry import HEALTH_NAMES, Registry

UNREGISTERED_MODEL = "<unregistered>"

# Route is a dictionary lookup and a min(); these buckets resolve microseconds.
_LATENCY_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.05,
)


class _RegistryCollector(Collector):
    """Gauges read from the registry at scrape time (never stale)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        proxies = GaugeMetricFamily(
            "areal_router_proxies",
            "Registered proxies by model and health",
            labels=["model", "health"],
        )
        counts: dict[tuple[str, str], int] = {}
        for model in self._registry.models.values():
            for name in HEALTH_NAMES.values():
                counts[(model.name, name)] = 0
        for p in self._registry.proxies.values():
            key = (p.model, HEALTH_NAMES.get(p.health, "unknown"))
            counts[key] = counts.get(key, 0) + 1
        for (model_name, health), n in sorted(counts.items()):
            proxies.add_metric([model_name, health], n)
        yield proxies
        models = GaugeMetricFamily("areal_router_models", "Registered models")
        models.add_metric([], len(self._registry.models))
        yield models
        pins = GaugeMetricFamily("areal_router_session_pins", "Sessions pinned to a proxy")
        pins.add_metric([], len(self._registry.pins))
        yield pins
        yield from _admission_gauges(self._registry)


def _admission_gauges(registry: Registry) -> Iterator[GaugeMetricFamily]:
    """Per model under admission control (areal_router.admission): its weight version,
    its sessions by state, the room left (-1: no bound), and the starts waiting for room."""
    adm = registry.admission
    families = {
        "version": GaugeMetricFamily(
            "areal_admission_version", "Weight version the admission rule uses", labels=["model"]
        ),
        "capacity_left": GaugeMetricFamily(
            "areal_admission_capacity_left",
            "Sessions a start may still add now (-1: no bound)",
            labels=["model"],
        ),
        "running": GaugeMetricFamily(
            "areal_admission_running", "Admitted sessions not yet ended", labels=["model"]
        ),
        "ended": GaugeMetricFamily(
            "areal_admission_ended",
            "Ended sessions not yet exported and acknowledged",
            labels=["model"],
        ),
        "consumed": GaugeMetricFamily(
            "areal_admission_consumed",
            "Sessions exported and acknowledged (consumed by the trainer)",
            labels=["model"],
        ),
        "waiting": GaugeMetricFamily(
            "areal_admission_waiting", "Session starts waiting for room", labels=["model"]
        ),
    }
    for name in sorted(adm.models):
        st = adm.state(name)
        for key, fam in families.items():
            fam.add_metric([name], float(getattr(st, key)))
    yield from families.values()


class RouterMetrics:
    def __init__(self, registry: Registry) -> None:
        self.prom = CollectorRegistry()
        self.decisions = Counter(
            "areal_router_route_decisions",
            "Route calls by policy, model and result",
            ["policy", "model", "result"],
            registry=self.prom,
        )
        self.route_latency = Histogram(
            "areal_router_route_latency_seconds",
            "Time to take a routing decision",
            buckets=_LATENCY_BUCKETS,
            registry=self.prom,
        )
        self.leases = Counter(
            "areal_router_route_leases",
            "Route calls answered with a route lease, by model",
            ["model"],
            registry=self.prom,
        )
        self.binds = Counter(
            "areal_router_bind_sessions",
            "BindSession calls by result",
            ["result"],
            registry=self.prom,
        )
        self.admissions = Counter(
            "areal_admission_sessions",
            "Sessions asking to start under admission control, by model and result "
            "(admitted, capacity_exhausted, staleness_bound)",
            ["model", "result"],
            registry=self.prom,
        )
        self.polls = Counter(
            "areal_router_health_polls",
            "GetStats polls of proxies by result",
            ["result"],
            registry=self.prom,
        )
        self.prom.register(_RegistryCollector(registry))

    def poll(self, ok: bool) -> None:
        self.polls.labels(result="ok" if ok else "error").inc()
