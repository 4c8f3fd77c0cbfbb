"""How each coding-agent harness is pointed at an areal gateway: its command line, its
environment and the config files it reads, as a user would set them.

Only base URL, key and model are areal's; the rest keeps a harness from reaching the
network or asking a person: a private HOME, no telemetry or update checks, and the flag
that lets a headless run use its shell tool.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from testpaths import ROOT

HARNESSES = ("claude", "codex", "opencode", "mini")
TASK = (
    "Write the proof file areal-proof.txt with your shell tool, list the folder, "
    "then answer in one line."
)
# What each harness's requests stream: none of them lets a user choose, except through
# settings that change what it does (mini-swe-agent's model class), so each runs the way it
# ships.
STREAMS = {"claude": True, "codex": True, "opencode": True, "mini": False}


def installed() -> dict[str, str]:
    """name -> executable of the pinned harnesses (scripts/install-harnesses.sh --where),
    empty when they are not installed."""
    r = subprocess.run(
        [str(ROOT / "scripts" / "install-harnesses.sh"), "--where"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return {}
    return dict(line.split("=", 1) for line in r.stdout.split())


@dataclass(frozen=True)
class Run:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    # mini-swe-agent's trajectory file (its exit status and submission), else None.
    trajectory: Path | None = None


def _base_env(home: Path) -> dict[str, str]:
    return {
        "HOME": str(home),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
    }


@dataclass(frozen=True)
class Bounds:
    """Limits for a run on a real small model on the CPU, which may never submit and may
    write until its context is full (a few tokens a second): each harness's own setting
    for a model's context, its output per call and (mini-swe-agent) its steps."""

    context: int
    output: int
    steps: int


def prepare(
    name: str,
    exe: str,
    gateway: str,
    key: str,
    model: str,
    root: Path,
    *,
    bounds: Bounds | None = None,
) -> Run:
    """A fresh HOME and work folder under `root`, the harness's config written there."""
    home, work = root / "home", root / "work"
    home.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = _base_env(home)
    if name == "claude":
        env.update(
            ANTHROPIC_BASE_URL=gateway,
            ANTHROPIC_API_KEY=key,
            DISABLE_TELEMETRY="1",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_AUTOUPDATER="1",
        )
        # -p: headless; --allowedTools: a headless run may use Bash without asking.
        argv = [exe, "-p", TASK, "--model", model, "--allowedTools", "Bash"]
        return Run(argv, env, work)
    if name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\n'
            'model_provider = "areal"\n'
            "[model_providers.areal]\n"
            'name = "areal"\n'
            f'base_url = "{gateway}/v1"\n'
            'env_key = "AREAL_API_KEY"\n'
            'wire_api = "responses"\n'
        )
        env.update(CODEX_HOME=str(codex_home), AREAL_API_KEY=key)
        # The work folder is no git repository; exec refuses to run outside one otherwise.
        argv = [exe, "exec", "--skip-git-repo-check", "-C", str(work), TASK]
        return Run(argv, env, work)
    if name == "opencode":
        config = home / "opencode.json"
        config.write_text(
            json.dumps(
                {
                    "$schema": "https://opencode.ai/config.json",
                    "autoupdate": False,
                    "share": "disabled",
                    "provider": {
                        "areal": {
                            "npm": "@ai-sdk/openai-compatible",
                            "name": "areal",
                            "options": {
                                "baseURL": f"{gateway}/v1",
                                "apiKey": "{env:AREAL_API_KEY}",
                            },
                            "models": {model: _opencode_model(model, bounds)},
                        }
                    },
                    "model": f"areal/{model}",
                },
                indent=2,
            )
        )
        env.update(OPENCODE_CONFIG=str(config), AREAL_API_KEY=key)
        return Run([exe, "run", TASK], env, work)
    if name == "mini":
        trajectory = root / "trajectory.json"
        env.update(
            # litellm's price list from its own package, not the network; an unknown
            # model has no price (mini-swe-agent's documented switch for local models).
            LITELLM_LOCAL_MODEL_COST_MAP="True",
            MSWEA_COST_TRACKING="ignore_errors",
            # No first-run questions (its global config file would set this).
            MSWEA_CONFIGURED="true",
        )
        argv = [
            exe,
            "-y",
            "--exit-immediately",
            "-m",
            f"openai/{model}",
            "-t",
            TASK,
            "-c",
            "mini.yaml",
            "-c",
            f"model.model_kwargs.api_base={gateway}/v1",
            "-c",
            f"model.model_kwargs.api_key={key}",
            "-o",
            str(trajectory),
        ]
        if bounds:
            argv += [
                "-c",
                f"agent.step_limit={bounds.steps}",
                "-c",
                f"model.model_kwargs.max_tokens={bounds.output}",
            ]
        return Run(argv, env, work, trajectory)
    raise ValueError(f"unknown harness {name!r} (known: {', '.join(HARNESSES)})")


def _opencode_model(model: str, bounds: Bounds | None) -> dict[str, object]:
    entry: dict[str, object] = {"name": model}
    if bounds:
        # OpenCode asks for at most limit.output tokens (32000 when unset).
        entry["limit"] = {"context": bounds.context, "output": bounds.output}
    return entry
