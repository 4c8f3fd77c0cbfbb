"""areal-cli."""

__version__ = "0.1.2"
