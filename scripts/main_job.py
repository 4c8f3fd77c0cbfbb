"""Start the bundled engine, generate with the project's client, stop cleanly."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from areal_cli import engines, supervisor
from areal_proxy.engine import GenerationRequest
from areal_proxy.engine.sglang import SGLangClient

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-parrot"


async def generate(url: str) -> None:
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    ids = tok.encode("Hello from areal").ids
    client = SGLangClient(url, timeout=60)
    try:
        out = await client.generate(GenerationRequest(ids, max_new_tokens=8, temperature=0))
        print(f"prompt ids    {ids}")
        print(f"output ids    {out.token_ids}  ({out.finish_reason})")
        print(f"output text   {tok.decode(out.token_ids)!r}")
        print(f"logprobs      {[round(x, 6) for x in out.logprobs]}")
        print("stream        ", end="", flush=True)
        async for chunk in client.generate_stream(
            GenerationRequest(ids, max_new_tokens=8, temperature=0)
        ):
            print(tok.decode(chunk.token_ids), end="|", flush=True)
        print()
    finally:
        await client.close()


def main() -> int:
    python = engines.resolve_python("sglang")
    port = supervisor.free_port()
    launch = engines.engine_launch(
        "sglang",
        python=python,
        model_path=str(MODEL),
        served_name="tiny-parrot",
        host="127.0.0.1",
        port=port,
        extra_args=engines.SGLANG_CPU_ARGS.split(),
    )
    log = Path(tempfile.mkdtemp(prefix="areal-main-job-")) / "engine.log"
    t0 = time.monotonic()
    proc, comp = supervisor.spawn("engine", launch.argv, log, env=launch.env)
    try:
        url = f"http://127.0.0.1:{port}"
        supervisor.wait_ready(proc, comp, lambda: supervisor.http_ok(url + "/health"), 300)
        print(f"engine healthy at {url} after {time.monotonic() - t0:.1f}s (log: {log})")
        asyncio.run(generate(url))
    except supervisor.LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        supervisor.terminate([[comp]], grace=10, procs={proc.pid: proc})
        print("engine stopped" if not supervisor.group_alive(comp) else "engine still running!")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
