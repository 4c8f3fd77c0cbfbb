"""areal-router."""

__version__ = "0.1.0"
