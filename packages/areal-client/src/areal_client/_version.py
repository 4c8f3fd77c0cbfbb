"""The package version, in one place (the User-Agent reports it)."""

__version__ = "0.1.6"
