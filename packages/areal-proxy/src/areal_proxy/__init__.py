"""areal-proxy."""

__version__ = "0.4.0"
