"""areal-gateway."""

__version__ = "0.3.5"
