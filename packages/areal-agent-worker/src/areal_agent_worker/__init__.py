"""areal-agent-worker."""

__version__ = "0.1.0"
