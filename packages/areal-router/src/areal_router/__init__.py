"""areal-router."""

__version__ = "0.2.1"
