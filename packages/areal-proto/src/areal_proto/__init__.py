"""areal-proto."""

__version__ = "0.2.1"
