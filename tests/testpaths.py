"""Paths the cross-package suites share (a module name no test folder reuses)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
PARROT = MODELS / "tiny-parrot"
RANDOM = MODELS / "tiny-random"
