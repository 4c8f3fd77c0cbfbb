"""What a long RL session costs the data proxy in memory: live (its last turns cached, so the
next turn continues them), evicted from that cache, and ended.

    uv run python benchmarks/session_memory.py [--turns 100] [--chars 4000] [--template hf]

The real proxy (`areal_proxy.server`, its gRPC service and SGLang client) runs in this process
in front of the *zero-cost fake engine* (benchmarks/fake_engine.py, a subprocess), so that
tracemalloc sees the proxy's own allocations: every trace whose innermost Python frame is in
`areal_proxy` (what orjson, the tokenizer or the template build is counted at the proxy line
that called them). The client's copy of the conversation is outside that filter. One session
of `--turns` turns, each the whole conversation so far plus a new `--chars`-character message
(random words), as `long_session.py` sends them; then the same session evicted from the turn
cache (what any session past `--prompt-cache-mb` costs), then ended.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import string
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import grpc
import orjson

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc
from areal_proxy.server import create_server
from areal_proxy.settings import Settings
from areal_runtime.session_keys import mint_key, new_id

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-parrot"


def proxy_bytes() -> int:
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*areal_proxy*"), tracemalloc.Filter(True, "*areal_runtime*")]
    )
    return sum(s.size for s in snap.statistics("filename"))


async def run(args: argparse.Namespace, engine_url: str) -> None:
    settings = Settings(
        engine_url=engine_url,
        model="tiny-parrot",
        tokenizer_path=str(MODEL),
        metrics_port=-1,
        db_path=":memory:",
        context_length=1_000_000,
        chat_template_type=args.template,
        log_level="warning",
    )
    server = create_server(settings)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = proxy_pb2_grpc.InferenceProxyServiceStub(channel)
    sid = new_id("sess")
    key = mint_key(sid)
    await stub.StartSessions(
        proxy_pb2.StartSessionsRequest(
            task_id="t",
            group_id="g",
            sessions=[proxy_pb2.SessionCredentials(session_id=sid, session_api_key=key)],
        )
    )
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    env = envelope_pb2.Envelope(api_key=key, session_id=sid)
    tracemalloc.start()
    base = proxy_bytes()
    tokens = 0
    for _ in range(args.turns):
        text = " ".join(rng.choices(words, k=args.chars // 4))[: args.chars]
        messages.append({"role": "user", "content": text})
        body = orjson.dumps({"messages": messages, "max_tokens": 16})
        r = orjson.loads(
            (await stub.ChatCompletion(envelope_pb2.OpenAIRequest(envelope=env, body=body))).body
        )
        tokens = r["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    live = proxy_bytes() - base
    cache = server.book.turns
    estimate = cache.nbytes
    cache.drop([sid])
    evicted = proxy_bytes() - base
    admin = envelope_pb2.Envelope(api_key="admin", is_admin=True)
    await stub.EndSessions(proxy_pb2.EndSessionsRequest(session_ids=[sid], envelope=admin))
    ended = proxy_bytes() - base
    tracemalloc.stop()
    await channel.close()
    await server.shutdown()
    mb = 2**20
    print(
        f"one {args.template} session of {args.turns} turns, {tokens:,} prompt tokens at its "
        f"last turn, {len(orjson.dumps(messages)) / 1e3:,.0f} kB of messages:"
    )
    print("| state | proxy memory | per prompt token |")
    print("| --- | --- | --- |")
    for name, b in (
        ("live (last turns cached)", live),
        ("evicted from the turn cache", evicted),
        ("ended", ended),
    ):
        print(f"| {name} | {b / mb:,.2f} MB | {b / max(tokens, 1):,.1f} B |")
    print(f"(the cache's own estimate while live: {estimate / mb:,.2f} MB)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--chars", type=int, default=4000)
    ap.add_argument("--template", default="hf", choices=["hf", "concat"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "engine.json"
        engine = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "fake_engine.py"),
                "--ready-file",
                str(ready),
            ]
        )
        try:
            deadline = time.monotonic() + 30
            while not (ready.exists() and ready.read_text().strip()):
                if time.monotonic() > deadline or engine.poll() is not None:
                    raise RuntimeError("the fake engine did not start")
                time.sleep(0.05)
            port = json.loads(ready.read_text())["port"]
            asyncio.run(run(args, f"http://127.0.0.1:{port}"))
        finally:
            engine.terminate()
            engine.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
