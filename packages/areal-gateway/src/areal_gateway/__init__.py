"""areal-gateway."""

__version__ = "0.4.3"
