"""areal training side: experiment configs and stdlib-only driver helpers (no torch)."""

__version__ = "0.1.3"
