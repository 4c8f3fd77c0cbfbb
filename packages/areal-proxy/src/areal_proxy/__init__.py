"""areal-proxy."""

__version__ = "0.2.5"
