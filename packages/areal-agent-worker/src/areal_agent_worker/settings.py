"""Settings of areal-agent-worker: every default once (flags, or AREAL_AGENT_WORKER_*)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Settings:
    agent: str = field(
        default="", metadata={"help": "the agent class, package.module.Class (required)"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "port; 0 = the OS picks"})
    log_level: str = field(
        default="info", metadata={"choices": ["debug", "info", "warning", "error"]}
    )
    ready_file: str = field(
        default="", metadata={"help": "write {pid, host, port, ...} here once listening"}
    )
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus port; 0 = the OS picks, -1 = off"}
    )
    drain_timeout: float = field(
        default=10.0, metadata={"help": "seconds to finish running turns on SIGTERM"}
    )
