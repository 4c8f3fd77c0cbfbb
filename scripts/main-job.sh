#!/usr/bin/env bash
# The main job on the embedded default: set up (idempotent), start the bundled
# tiny parrot model on a CPU SGLang engine, generate through the project's
# engine client, and stop the engine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/bootstrap.sh
exec uv run --quiet python scripts/main_job.py "$@"
