"""The OpenAI-compatible HTTP API of the gateway (inference mode)."""
