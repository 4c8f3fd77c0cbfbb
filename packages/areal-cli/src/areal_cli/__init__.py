"""areal-cli."""

__version__ = "0.4.1"
