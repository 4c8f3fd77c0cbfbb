"""The main job on the embedded default: an areal inference service on the bundled tiny model.

1. `areal inf run --detach` starts router, gateway, a CPU SGLang engine and its data proxy;
2. a chat completion through the gateway with the official openai SDK;
3. an RL session: a recorded chat with the session key, a reward, the exported trajectory;
4. `areal inf stop`.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from areal_cli.supervisor import free_port
from areal_client import ArealClient

ROOT = Path(__file__).resolve().parent.parent
MODEL_PATH = ROOT / "models" / "tiny-parrot"
SERVICE = "main-job"


def areal(*args: str, env: dict[str, str], show: bool = True) -> subprocess.CompletedProcess[str]:
    print(f"$ areal {' '.join(args)}", flush=True)
    done = subprocess.run(["areal", *args], env=env, text=True, capture_output=True)
    if show and done.stdout.strip():
        print(done.stdout.rstrip())
    if done.returncode != 0:
        print(done.stderr.rstrip(), file=sys.stderr)
        raise SystemExit(done.returncode)
    return done


def main() -> int:
    home = Path(os.environ.get("AREAL_HOME") or tempfile.mkdtemp(prefix="areal-home-"))
    key = secrets.token_urlsafe(24)
    port = free_port()
    env = {**os.environ, "AREAL_HOME": str(home), "AREAL_ADMIN_API_KEY": key}
    t0 = time.monotonic()
    areal(
        "inf",
        "run",
        "--service",
        SERVICE,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        "tiny-parrot",
        "--backend",
        "sglang:d1",
        "--model-path",
        str(MODEL_PATH),
        "--proxy-args",
        "--chat-template-type concat",
        "--detach",
        env=env,
    )
    print(f"service up in {time.monotonic() - t0:.1f}s (AREAL_HOME={home})\n")
    try:
        status = json.loads(
            areal("inf", "status", "--service", SERVICE, "--json", env=env, show=False).stdout
        )
        url = status["gateway"]["url"]
        areal("inf", "ps", env=env)

        llm = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        r = llm.chat.completions.create(
            model="tiny-parrot",
            messages=[{"role": "user", "content": "Hi, give me a quick intro to AReaL."}],
            max_tokens=8,
            temperature=0,
        )
        print(
            f"\nchat completion: {r.choices[0].message.content!r} ({r.choices[0].finish_reason}, "
            f"{r.usage.completion_tokens} tokens)"
        )

        with ArealClient(url, key) as client:
            group = client.start_group(task_id="demo-task", group_size=1)
            [session] = group.sessions
            answer = session.openai(max_retries=0).chat.completions.create(
                model=group.model,
                messages=[{"role": "user", "content": "What is 2 + 3?"}],
                max_tokens=4,
            )
            client.set_reward(session, reward=1.0)
            [row] = client.export(group_id=group.group_id, remove_session=True).rows
        print(f"\nRL session {session.session_id}: interaction {answer.id} rewarded 1.0")
        print("exported trajectory:")
        for k in ("input_ids", "loss_mask", "logprobs", "versions"):
            v = getattr(row, k)
            shown = [round(x, 4) for x in v] if k == "logprobs" else v
            print(f"  {k:<10} {shown}")
        print(f"  reward     {row.reward}")
    finally:
        print()
        areal("inf", "stop", "--service", SERVICE, env=env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
