"""`areal inf deregister --replica R`: the graceful drain of one replica (a scale-down).

Order: the gateway retires the replica's data proxy (no new work reaches its engine; the
requests on the engine get `--drain-timeout` seconds, then move to another replica with
the tokens they have), then the engine is stopped. The data proxy stays: it owns the
recordings of the sessions pinned to it, and serves their turns on the other replicas'
engines, their rewards and exports, until the model is deregistered or the service stops.
"""

from __future__ import annotations

import time
from typing import Any

from areal_cli import state as st
from areal_cli.config import Config
from areal_cli.errors import CLIError
from areal_cli.http import call, error_message
from areal_cli.inf.registration import running_service
from areal_cli.reconcile import components, terminate_components

GROUP = "inf"
# Seconds for what follows the drain (evacuated requests leaving the engine, the answer).
_SLACK_S = 60.0
# Seconds the engine gets to exit on SIGTERM once nothing runs on it.
_ENGINE_GRACE_S = 10.0
# The flag a retired proxy is restarted with (the watchdog restarts from the recorded argv).
RETIRED_FLAG = "--retired"


def deregister_replica(
    cfg: Config, service: str | None, name: str, rank: int, drain_timeout: float
) -> int:
    service = st.check_name("service", cfg.pick(service, "default", "service", "default"))
    st.check_name("model", name)
    if not drain_timeout >= 0:
        raise CLIError(f"--drain-timeout must be 0 or more (got {drain_timeout:g})", code=2)
    t0 = time.monotonic()
    with st.locked(GROUP, service, wait=5):
        s, url, key = running_service(service)
        record = (s.get("models") or {}).get(name)
        if record is None:
            raise CLIError(
                f"model '{name}' has no replicas started by this CLI on inf service "
                f"'{service}' (see `areal inf models --service {service}`)"
            )
        replicas: list[dict[str, Any]] = record["replicas"]
        rep = next((r for r in replicas if r.get("rank") == rank), None)
        if rep is None:
            ranks = ", ".join(str(r.get("rank")) for r in replicas)
            raise CLIError(f"model '{name}' has no replica {rank} (replicas: {ranks})", code=2)
        if rep.get("retired"):
            print(f"replica {rank} of model '{name}' is already retired; nothing to do")
            return 0
        if s.get("scheduler") == "ray":
            raise CLIError(
                "--replica works with the local scheduler only: on a Ray cluster a replica's "
                "engine and data proxy share one unit host; deregister the model instead"
            )
        serving = [r for r in replicas if not r.get("retired")]
        if len(serving) <= 1:
            raise CLIError(
                f"replica {rank} is the last serving replica of model '{name}': no other "
                "replica could take its requests; deregister the model instead "
                f"(`areal inf deregister --service {service} --model-name {name}`)"
            )
        proxy_id = rep.get("proxy_id") or rep["data_proxy"]
        status, payload = call(
            "POST",
            f"{url}/admin/workers/{proxy_id}/retire",
            key=key,
            body={"drain_timeout": drain_timeout},
            timeout=drain_timeout + _SLACK_S,
        )
        if status != 200 or not isinstance(payload, dict):
            raise CLIError(
                f"gateway refused to retire replica {rank} of model '{name}': HTTP {status}: "
                f"{error_message(payload)}; nothing was stopped"
            )
        comps = components(s)
        worker = comps.get(rep["worker"])
        if worker is not None:
            survivors = terminate_components([worker], grace=_ENGINE_GRACE_S)
            if survivors:
                raise CLIError(
                    f"replica {rank} is retired but its engine {rep['worker']} did not stop; "
                    "run the command again"
                )
        s["components"].pop(rep["worker"], None)
        (st.run_dir(GROUP, service) / f"{rep['worker']}.ready").unlink(missing_ok=True)
        proxy = s["components"].get(rep["data_proxy"])
        if proxy is not None and RETIRED_FLAG not in proxy.get("argv", []):
            proxy["argv"] = [*proxy.get("argv", []), RETIRED_FLAG]
        rep["retired"] = True
        st.save(GROUP, service, s)
    print(
        f"replica {rank} of model '{name}' retired in {time.monotonic() - t0:.1f}s: "
        f"{payload.get('finished', 0)} request(s) finished on its engine, "
        f"{payload.get('moved', 0)} moved to other replicas, "
        f"{payload.get('failed', 0)} could not move; engine stopped. "
        f"Its data proxy {proxy_id} stays up for the sessions pinned to it."
    )
    return 0
