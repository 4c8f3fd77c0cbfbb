"""areal-proxy."""

__version__ = "0.6.0"
