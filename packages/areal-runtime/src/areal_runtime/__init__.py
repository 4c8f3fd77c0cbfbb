"""The hand-written runtime shared by every areal service.

The wire conventions of docs/services.md in one place: settings from flags and
environment, the ready file, OpenAI-shaped errors over gRPC status, the
internal-token check, and logging that never prints a secret. The generated
contract lives apart, in areal-proto; this package is everything a service
needs around it.
"""

__version__ = "0.2.4"
