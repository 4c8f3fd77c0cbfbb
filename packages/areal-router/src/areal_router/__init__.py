"""areal-router."""

__version__ = "0.5.1"
