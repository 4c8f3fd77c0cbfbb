"""The only code that touches gRPC stubs (docs/services.md, "Internal gRPC calls").

`RouterClient` wraps the router; `ProxyPool` hands out one `ProxyClient` per proxy address,
each on one channel that every request to that address reuses (generation over one
multiplexed `Generate` stream); `AgentProxyPool` does the same for agent-mode proxies. Every
call carries the internal token as metadata (computed once, not per call). Failed calls
surface as `ServiceError` (or its subclass `ProxyUnreachable`), never as `grpc.RpcError`.
"""

from areal_gateway.clients.agent import SESSION_KEY_METADATA, AgentProxyClient, AgentProxyPool
from areal_gateway.clients.common import ProxyUnreachable
from areal_gateway.clients.proxy import (
    GenerateStream,
    GenerationRequest,
    ProxyClient,
    ProxyPool,
    generation_request,
)
from areal_gateway.clients.router import RouterClient

__all__ = [
    "SESSION_KEY_METADATA",
    "AgentProxyClient",
    "AgentProxyPool",
    "GenerateStream",
    "GenerationRequest",
    "ProxyClient",
    "ProxyPool",
    "ProxyUnreachable",
    "RouterClient",
    "generation_request",
]
