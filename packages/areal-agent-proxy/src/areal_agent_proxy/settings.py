"""Every areal-agent-proxy flag, each default once (docs/services.md, "Flags per binary").

The environment prefix stays `AREAL_PROXY_`, the one this proxy read when it was a mode of
areal-proxy: the CLI hands the linked gateway's admin key over as
`AREAL_PROXY_INF_ADMIN_API_KEY`, and a deployment that set its flags so keeps working."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from areal_agent_proxy import __version__
from areal_runtime.settings import parse_settings

ENV_PREFIX = "AREAL_PROXY_"


@dataclass
class Settings:
    # Common to every areal service.
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "gRPC port; 0 = the OS picks"})
    log_level: str = field(
        default="info", metadata={"choices": ["debug", "info", "warning", "error"]}
    )
    ready_file: str = field(default="", metadata={"help": "write host/port here once listening"})
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus /metrics port; 0 = the OS picks, -1 = off"}
    )
    proxy_id: str = field(default="", metadata={"help": "stable id reported in stats"})
    request_timeout: float = field(default=3600.0, metadata={"help": "seconds for one agent turn"})
    drain_timeout: float = field(
        default=10.0, metadata={"help": "seconds to finish running turns on SIGTERM"}
    )
    # The agent worker behind, and the inference service that records its LLM calls.
    worker_addr: str = field(default="", metadata={"help": "host:port of the agent worker"})
    session_timeout: float = field(
        default=1800.0, metadata={"help": "seconds an idle agent session lives"}
    )
    inf_gateway_url: str = field(
        default="", metadata={"help": "inference gateway that records the agent's LLM calls"}
    )
    inf_model: str = field(default="", metadata={"help": "model the agent's LLM calls use"})
    inf_admin_api_key: str = field(
        default="", metadata={"secret": True, "help": "admin key of the linked inference gateway"}
    )

    def problems(self) -> list[str]:
        """What is missing (empty when the settings are usable)."""
        out = []
        if not self.worker_addr:
            out.append("--worker-addr is required (host:port of the agent worker)")
        elif ":" not in self.worker_addr:
            out.append("--worker-addr must be host:port")
        if self.session_timeout <= 0:
            out.append("--session-timeout must be > 0")
        return out


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    return parse_settings(
        Settings,
        argv,
        prog="areal-agent-proxy",
        env_prefix=ENV_PREFIX,
        version=__version__,
        description="areal data proxy in front of one agent worker (gRPC AgentProxyService).",
    )
