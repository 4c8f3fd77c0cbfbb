"""Paths and fixed settings the cross-package suites share (a module name no test folder
reuses)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
PARROT = MODELS / "tiny-parrot"
RANDOM = MODELS / "tiny-random"

# vLLM's tests give it a context far beyond the models' 2048 (max_position_embeddings
# overridden, so RoPE covers it) so that a request it should abort takes ~a minute to run
# out: vLLM's API server, sharing a core with its busy scheduler, can take seconds to notice
# a disconnect, longer than 2048 tokens take. The parrot ignores positions (its attention
# output is zeroed), so its answers do not change.
VLLM_TEST_CONTEXT = 32768
