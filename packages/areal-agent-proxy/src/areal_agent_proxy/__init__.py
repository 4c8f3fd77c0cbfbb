"""areal-agent-proxy: the data proxy in front of one agent worker."""

__version__ = "0.1.0"
