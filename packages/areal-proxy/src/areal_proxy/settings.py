"""Every areal-proxy flag, each default once (docs/services.md, "Flags per binary")."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from areal_proxy import __version__
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
    # Only "inference" serves; "agent" is still a choice so that the command line of a data
    # proxy before agent mode became areal-agent-proxy gets a pointer there, not "invalid
    # choice".
    mode: str = field(
        default="inference",
        metadata={
            "choices": ["inference", "agent"],
            "help": "inference (the agent worker's proxy is the areal-agent-proxy binary)",
        },
    )
    # The engine replica this proxy sits in front of.
    engine_url: str = field(default="", metadata={"help": "base URL of the engine replica"})
    engine: str = field(default="sglang", metadata={"choices": ["sglang", "vllm"]})
    model: str = field(default="", metadata={"help": "served model name"})
    tokenizer_path: str = field(
        default="", metadata={"help": "folder with tokenizer.json + tokenizer_config.json"}
    )
    proxy_id: str = field(default="", metadata={"help": "stable id reported in stats"})
    chat_template_type: str = field(
        default="concat",
        metadata={
            "choices": ["concat", "hf"],
            "help": "how a session's turn is prompted: concat continues the exact ids of the "
            "turn it extends (what the model saw and sampled) and tokenizes only the new "
            "messages; hf tokenizes the whole rendered conversation again",
        },
    )
    request_timeout: float = field(default=3600.0, metadata={"help": "seconds for one engine call"})
    set_reward_finish_timeout: float = field(
        default=0.0, metadata={"help": "seconds a trajectory stays open after a reward"}
    )
    tool_call_parser: str = field(default="", metadata={"help": "e.g. hermes, qwen25, llama3"})
    reasoning_parser: str = field(default="", metadata={"help": "e.g. qwen3, deepseek-r1"})
    # Off by default: with it, SGLang 0.5.23 (xgrammar 0.2.7) failed 15 of 30 forced requests
    # on the parrot model with a 500 "Grammar accept_token failed": its xgrammar compiler
    # cache mixes up token-level structural tags; docs/openai-api.md, "Forced tool calls".
    forced_call_token_ids: bool = field(
        default=False,
        metadata={
            "help": "constrain a forced tool call's fixed text as the tokenizer's own token ids "
            "(the tokens the model would write) instead of as text"
        },
    )
    engine_max_tokens: int = field(
        default=0, metadata={"help": "cap on max_tokens (0 = context length only)"}
    )
    context_length: int = field(
        default=0, metadata={"help": "0 = max_position_embeddings from the model config"}
    )
    drain_timeout: float = field(
        default=10.0, metadata={"help": "seconds to finish in-flight work on SIGTERM"}
    )
    engine_health_interval: float = field(
        default=2.0, metadata={"help": "seconds between background engine health checks"}
    )
    engine_stall_timeout: float = field(
        default=60.0,
        metadata={
            "help": "seconds without a token, an answer or a health check answered in time "
            "after which an engine whose health check does not answer counts as stalled "
            "(before that it is busy, and stays healthy); a refused connection is decisive "
            "at once"
        },
    )
    max_inflight: int = field(
        default=512,
        metadata={
            "help": "generation requests this proxy holds at once (the engine queues them); "
            "past it a new one is refused with 429 `overloaded` and a Retry-After (0 = no bound)"
        },
    )
    # Migration: a request whose engine dies continues on another replica's engine.
    router_addr: str = field(
        default="",
        metadata={
            "help": "host:port of the router, asked for the other healthy replicas of this "
            "model when the engine dies under a request (migration); empty = no migration"
        },
    )
    migration_limit: int = field(
        default=3,
        metadata={
            "help": "replicas one request may move to after engines died under it "
            "(0 = never migrate)"
        },
    )
    retired: bool = field(
        default=False,
        metadata={
            "help": "start retired (graceful drain done): generate on other replicas' engines "
            "only, serving the sessions pinned here (the CLI restarts a retired proxy so)"
        },
    )

    # RL recording (inference mode).
    db_path: str = field(
        default="",
        metadata={
            "help": "SQLite file of recorded sessions; empty: $AREAL_HOME/proxy/<proxy-id>.sqlite"
        },
    )
    lost_data: str = field(
        default="",
        metadata={
            "help": "set by a cluster scheduler for a replica placed again on another node "
            "without the data it had recorded: a session this proxy does not know is answered "
            "with this explanation (replica_data_lost) rather than a plain not found"
        },
    )
    session_ttl: float = field(
        default=3600.0, metadata={"help": "seconds an idle RL session lives before it is ended"}
    )
    retention_seconds: float = field(
        default=86400.0,
        metadata={
            "help": "seconds an ended and exported RL session's records are kept before they "
            "are deleted (0 = kept until an export removes them)"
        },
    )
    max_live_sessions: int = field(
        default=10000, metadata={"help": "RL sessions kept in memory (the rest reload from SQLite)"}
    )
    prompt_cache_mb: int = field(
        default=512,
        metadata={
            "help": "MiB of memory for the last turns of live RL sessions, which their next "
            "turns continue instead of tokenizing the whole conversation again; least "
            "recently used sessions are evicted past it (0 = off: every turn is tokenized whole)"
        },
    )

    def resolved_db_path(self) -> str:
        if self.db_path:
            return self.db_path
        home = os.environ.get("AREAL_HOME") or os.path.join(os.path.expanduser("~"), ".areal")
        name = self.proxy_id or self.model or "proxy"
        return os.path.join(home, "proxy", f"{name}.sqlite")

    def problems(self) -> list[str]:
        """What is missing for the chosen mode (empty when the settings are usable)."""
        if self.mode == "agent":
            return [
                "--mode agent: the agent worker's data proxy is its own binary now; run "
                "areal-agent-proxy --worker-addr HOST:PORT (package areal-agent-proxy)"
            ]
        out = []
        for name in ("engine_url", "model", "tokenizer_path"):
            if not getattr(self, name):
                out.append(f"--{name.replace('_', '-')} is required")
        if self.engine_max_tokens < 0:
            out.append("--engine-max-tokens must be >= 0")
        if self.context_length < 0:
            out.append("--context-length must be >= 0")
        if self.retention_seconds < 0:
            out.append("--retention-seconds must be >= 0")
        if self.engine_stall_timeout <= 0:
            out.append("--engine-stall-timeout must be > 0")
        if self.max_inflight < 0:
            out.append("--max-inflight must be >= 0")
        if self.migration_limit < 0:
            out.append("--migration-limit must be >= 0")
        if self.router_addr and ":" not in self.router_addr:
            out.append("--router-addr must be host:port")
        return out


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    return parse_settings(
        Settings,
        argv,
        prog="areal-proxy",
        env_prefix=ENV_PREFIX,
        version=__version__,
        description="areal data proxy in front of one engine replica (gRPC ProxyService).",
    )
