"""areal-proto."""

__version__ = "0.1.0"
