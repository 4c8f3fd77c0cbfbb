#!/usr/bin/env bash
# The main job: set up (idempotent: uv, venv, engines, the SmolLM2-135M-Instruct
# model), serve the model with `areal inf run` on a CPU SGLang engine, stream a
# chat answer through the gateway with the openai SDK, record an RL session
# (reward, exported trajectory), and stop the service (scripts/main_job.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/bootstrap.sh
exec uv run --quiet python scripts/main_job.py "$@"
