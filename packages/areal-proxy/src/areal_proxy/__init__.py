"""areal-proxy."""

__version__ = "0.3.8"
