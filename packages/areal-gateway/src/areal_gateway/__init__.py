"""areal-gateway."""

__version__ = "0.5.1"
