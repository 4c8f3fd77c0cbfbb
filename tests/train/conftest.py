"""Fixtures for the training examples: the trainer process (torch lives in the engine venv)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `examples` is imported from the checkout, like the CLI does

from examples.math.trainer_client import TrainerClient, resolve_trainer_python  # noqa: E402

TINY = ROOT / "models" / "tiny-random"


@pytest.fixture(scope="session")
def trainer_python() -> str:
    return resolve_trainer_python(os.environ.get("AREAL_TRAINER_PYTHON", ""))


@pytest.fixture(scope="module")
def trainer(
    trainer_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TrainerClient]:
    log = tmp_path_factory.mktemp("trainer") / "trainer.log"
    client = TrainerClient.start(trainer_python, log)
    info = client.call(
        "init",
        model_path=str(TINY),
        seed=1,
        num_threads=2,
        optimizer={"lr": 1e-2, "gradient_clipping": 1.0},
        total_steps=100,
        ref_model=True,
    )
    client.info.update(info)
    yield client
    assert client.close() == 0


@pytest.fixture(scope="module")
def model_ready() -> None:
    """SmolLM2 is set up (scripts/setup-model.sh); the SmolLM2 examples skip without it, unless
    AREAL_TEST_REQUIRE_REAL_MODEL=1 (CI's SmolLM2 stage) makes its absence a failure."""
    from areal_cli.errors import CLIError
    from areal_cli.models import resolve_short_name

    try:
        resolve_short_name("smollm2")
    except CLIError as e:
        if os.environ.get("AREAL_TEST_REQUIRE_REAL_MODEL") == "1":
            raise
        pytest.skip(str(e))
