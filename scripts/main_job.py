"""The main job: an areal inference service on the real instruct model SmolLM2-135M-Instruct.

1. `areal inf run --detach` starts router, gateway, a CPU SGLang engine and its data proxy,
   the model given by its short name (`--model-path smollm2`: the folder
   scripts/setup-model.sh wrote under ~/.cache/areal/models);
2. a chat completion through the gateway with the official openai SDK, streamed;
3. an RL session: a recorded chat with the session key, a reward checked from its answer,
   the exported trajectory;
4. `areal inf stop`.

    scripts/main-job.sh [--model-path PATH] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from areal_cli.supervisor import free_port
from areal_client import ArealClient

SERVICE = "main-job"
MODEL = "smollm2-135m-instruct"
REQUEST = "Hi, give me a quick intro to AReaL."
QUESTION = "What is 2 + 3? Answer with a number."
ANSWER = 5


def areal(*args: str, env: dict[str, str], show: bool = True) -> subprocess.CompletedProcess[str]:
    print(f"$ areal {' '.join(args)}", flush=True)
    done = subprocess.run(["areal", *args], env=env, text=True, capture_output=True)
    if show and done.stdout.strip():
        print(done.stdout.rstrip())
    if done.returncode != 0:
        print(done.stderr.rstrip(), file=sys.stderr)
        raise SystemExit(done.returncode)
    return done


def reward(text: str) -> float:
    """1.0 when the last number in the answer is the sum ("2 + 3 = 5"), else 0.0."""
    numbers = re.findall(r"-?\d+", text)
    return 1.0 if numbers and int(numbers[-1]) == ANSWER else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="smollm2", help="model folder or short name")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens of the streamed answer")
    a = p.parse_args(argv)
    if a.max_tokens < 1:
        p.error("--max-tokens must be at least 1")

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
        MODEL,
        "--backend",
        "sglang:d1",
        "--model-path",
        a.model_path,
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
        print(f"\nuser: {REQUEST}\nassistant: ", end="", flush=True)
        t1 = time.monotonic()
        first: float | None = None
        parts: list[str] = []
        finish = usage = None
        stream = llm.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": REQUEST}],
            max_tokens=a.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.monotonic()
                    parts.append(choice.delta.content)
                    print(choice.delta.content, end="", flush=True)
                finish = choice.finish_reason or finish
        text = "".join(parts)
        if not text.strip():
            print("\nmain job: the model streamed no text", file=sys.stderr)
            return 1
        n = usage.completion_tokens if usage is not None else None
        took = time.monotonic() - t1
        print(
            f"\n[streamed {len(parts)} chunks, {n} tokens, finish {finish}; first token "
            f"{(first or t1) - t1:.2f}s, all {took:.2f}s]"
        )

        with ArealClient(url, key) as client:
            group = client.start_group(task_id="demo-task", group_size=1)
            [session] = group.sessions
            answer = session.openai(max_retries=0).chat.completions.create(
                model=group.model,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=16,
                temperature=0,
            )
            said = answer.choices[0].message.content or ""
            r = reward(said)
            client.set_reward(session, reward=r)
            [row] = client.export(group_id=group.group_id, remove_session=True).rows
        print(f"\nRL session {session.session_id}: {QUESTION!r} -> {said!r}, reward {r}")
        out = [i for i, m in enumerate(row.loss_mask) if m]
        print(
            f"exported trajectory: {len(row.input_ids)} tokens, {len(out)} generated "
            f"(loss_mask 1); the generated ones:"
        )
        print(f"  input_ids  {[row.input_ids[i] for i in out]}")
        print(f"  logprobs   {[round(row.logprobs[i], 4) for i in out]}")
        print(f"  versions   {[row.versions[i] for i in out]}")
        print(f"  reward     {row.reward}")
    finally:
        print()
        areal("inf", "stop", "--service", SERVICE, env=env)
    print(f"main job done in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
