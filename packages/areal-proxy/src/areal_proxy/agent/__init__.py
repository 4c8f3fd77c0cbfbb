"""Agent mode: the data proxy in front of one agent worker (sessions, history, turns)."""
