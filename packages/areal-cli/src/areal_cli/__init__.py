"""areal-cli."""

__version__ = "0.2.2"
