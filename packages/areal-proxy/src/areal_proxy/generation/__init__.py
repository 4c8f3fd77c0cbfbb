"""One generation on an engine: its controller (pause, resume, weight versions) and migration to a peer."""
