"""areal-gateway."""

__version__ = "0.9.0"
