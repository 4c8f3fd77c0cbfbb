"""Import the user's agent class from `pkg.module.Class` with errors that say what to fix."""

from __future__ import annotations

import importlib
import inspect
from typing import Any


class AgentLoadError(Exception):
    pass


def load_agent(path: str) -> Any:
    module_name, dot, class_name = path.rpartition(".")
    if not dot or not module_name or not class_name:
        raise AgentLoadError(f"--agent must look like package.module.Class, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise AgentLoadError(
            f"cannot import module {module_name!r} for --agent {path}: {type(e).__name__}: {e}"
        ) from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise AgentLoadError(f"module {module_name!r} has no attribute {class_name!r}")
    if not isinstance(cls, type):
        raise AgentLoadError(f"{path} is not a class")
    run = getattr(cls, "run", None)
    if run is None:
        raise AgentLoadError(f"agent class {path} has no run method")
    if not inspect.iscoroutinefunction(run):
        raise AgentLoadError(f"{path}.run must be an async def")
    try:
        return cls()
    except Exception as e:
        raise AgentLoadError(f"{path}() failed: {type(e).__name__}: {e}") from e
