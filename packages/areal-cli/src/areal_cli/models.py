"""Models that `scripts/setup-model.sh` sets up, found by a short name.

`--model-path smollm2` means the folder that script wrote under the models cache
(`$AREAL_MODELS_DIR`, default `~/.cache/areal/models`); a path that exists is
always taken as a path, so a local folder named like a short name still wins.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_cli.errors import CLIError

# short name -> the folder scripts/setup-model.sh writes (and the marker it writes last).
KNOWN = {"smollm2": "SmolLM2-135M-Instruct"}
MARKER = ".areal-model-ok"


def models_dir() -> Path:
    if d := os.environ.get("AREAL_MODELS_DIR"):
        return Path(d)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "areal" / "models"


def resolve_short_name(path: str) -> str | None:
    """The cached folder for a short model name, None if `path` is not one.

    A short name whose set-up has not run (or did not finish) is a CLIError
    that says which command sets it up.
    """
    if path not in KNOWN or Path(path).expanduser().exists():
        return None
    folder = models_dir() / KNOWN[path]
    if not (folder / MARKER).is_file():
        raise CLIError(
            f"model '{path}' is not set up (no {folder / MARKER}): "
            f"run `scripts/setup-model.sh {path}`",
            code=2,
        )
    return str(folder)
