"""areal-gateway."""

__version__ = "0.6.0"
