"""areal-router."""

__version__ = "0.4.1"
