"""areal-cli."""

__version__ = "0.3.4"
