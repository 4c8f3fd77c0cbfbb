"""Hand-written runtime shared by every areal service (not generated).

The wire conventions of docs/services.md in one place: settings from flags and
environment, the ready file, OpenAI-shaped errors over gRPC status, the
internal-token check, and logging that never prints a secret.
"""
