"""areal-router."""

__version__ = "0.3.3"
