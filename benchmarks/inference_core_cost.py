"""CPU per request of the data proxy's inference core alone, whole and streamed, in one process.

    uv run python benchmarks/inference_core_cost.py [--requests 1500] [--rounds 3] [--baseline DIR]

Builds the proxy as `areal-proxy` does (`create_server`, the tiny parrot's tokenizer and chat
template, `--tool-call-parser hermes`) in front of an in-process engine that costs nothing
(every answer precomputed; a stream sends one token per chunk, as an engine decoding one
step at a time does) and calls the inference handler directly: no gRPC, no gateway, no
recording. What is measured is the work of the core itself, per request, from
`time.process_time`: the prelude (parse, template, tokenize, budget), the engine loop, the
text (detokenise, stop strings, output parsing, finish rules), the answer's bytes.

Rows: chat, chat whose answer is a tool call (parsed by hermes), completion; each whole and
streamed. Rounds interleave the rows; the table shows the median over rounds.

`--baseline DIR`: also run this same script with the Python of another checkout of the
repository (`DIR/.venv/bin/python`, a `git worktree` at the commit to compare with, after
`uv sync`), rounds alternating between the two (each round a fresh process), and print both
side by side with their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson

from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.engine.base import GenerationChunk, GenerationRequest, GenerationResult
from areal_proxy.server import create_server
from areal_proxy.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PARROT = ROOT / "models" / "tiny-parrot"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather like in Paris today?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROWS = ["chat", "chat, tool call", "completion"]


class ZeroEngine:
    """An engine whose answer to every request is `answers[kind]`, at no cost."""

    base_url = "http://zero-engine"

    def __init__(self, answers: dict[str, list[int]], eos: int) -> None:
        self.answers = answers
        self.eos = eos
        self.kind = "chat"

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        pass

    async def abort(self, rid: str | None = None) -> None:
        pass

    def _finish(self, ids: list[int]) -> str:
        return "stop" if ids and ids[-1] == self.eos else "length"

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        ids = self.answers[self.kind]
        return GenerationResult(
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            top_logprobs=[],
            finish_reason=self._finish(ids),
            prompt_tokens=len(req.input_ids),
        )

    async def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        ids = self.answers[self.kind]
        last = len(ids) - 1
        for i, token in enumerate(ids):
            yield GenerationChunk(
                token_ids=[token],
                logprobs=[-0.5],
                top_logprobs=[],
                finish_reason=self._finish(ids) if i == last else None,
                prompt_tokens=len(req.input_ids),
            )


def _bodies(tokens: int) -> dict[str, bytes]:
    chat = {"model": "tiny-parrot", "messages": MESSAGES, "max_tokens": tokens + 64}
    return {
        "chat": orjson.dumps(chat),
        "chat, tool call": orjson.dumps({**chat, "tools": TOOLS}),
        "completion": orjson.dumps(
            {"model": "tiny-parrot", "prompt": "The weather in Paris", "max_tokens": tokens + 64}
        ),
    }


async def _measure(requests: int, rounds: int, tokens: int) -> dict[str, list[float]]:
    tok = ModelTokenizer.from_dir(PARROT)
    eos = tok.eos_token_ids[0]
    text = " ".join(["sunny"] * tokens)
    plain = [*tok.encode(text)[:tokens], eos]
    answers = {"chat": plain, "completion": plain, "chat, tool call": [*tok.encode(CALL), eos]}
    engine = ZeroEngine(answers, eos)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(
            engine_url=engine.base_url,
            model="tiny-parrot",
            tokenizer_path=str(PARROT),
            metrics_port=-1,
            db_path=str(Path(tmp) / "bench.sqlite"),
            tool_call_parser="hermes",
        )
        server = create_server(settings, engine=engine)  # type: ignore[arg-type]
        handler = server.servicer.handler
        bodies = _bodies(tokens)

        async def one(row: str, stream: bool) -> None:
            engine.kind = "completion" if row == "completion" else row
            body = bodies[row]
            if row == "completion":
                if stream:
                    async for _ in handler.completion_stream(body):
                        pass
                else:
                    await handler.completion(body)
            elif stream:
                async for _ in handler.chat_stream(body):
                    pass
            else:
                await handler.chat(body)

        engine.kind = "chat, tool call"
        answer = orjson.loads((await handler.chat(bodies["chat, tool call"]))[0])
        if answer["choices"][0]["finish_reason"] != "tool_calls":
            raise SystemExit(f"the tool-call row's answer is no tool call: {answer}")
        out: dict[str, list[float]] = {}
        for row in ROWS:  # warm up every path (template compile, parser import, caches)
            for stream in (False, True):
                for _ in range(50):
                    await one(row, stream)
        for _ in range(rounds):
            for row in ROWS:
                for stream in (False, True):
                    gc.collect()
                    t0 = time.process_time()
                    for _ in range(requests):
                        await one(row, stream)
                    us = (time.process_time() - t0) / requests * 1e6
                    out.setdefault(f"{row}, {'stream' if stream else 'whole'}", []).append(us)
        server.db_executor.shutdown()
        server.cpu_executor.shutdown()
    return out


def _git_commit(cwd: Path) -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True
    )
    return done.stdout.strip() or "?"


def _one_round(python: str, cwd: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """One round of this script in its own process, with `python`'s packages."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(
            [
                python,
                str(Path(__file__).resolve()),
                "--requests",
                str(args.requests),
                "--rounds",
                "1",
                "--tokens",
                str(args.tokens),
                "--json",
                f.name,
            ],
            cwd=cwd,
            check=True,
        )
        result: dict[str, list[float]] = json.loads(Path(f.name).read_text())
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1500, help="per row and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens of a plain answer")
    ap.add_argument("--baseline", default="", help="another checkout to compare with")
    ap.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if args.json:
        Path(args.json).write_text(json.dumps(asyncio.run(_measure(args.requests, 1, args.tokens))))
        return 0
    here = _git_commit(ROOT)
    mine: dict[str, list[float]] = {}
    base: dict[str, list[float]] = {}
    if not args.baseline:
        mine = asyncio.run(_measure(args.requests, args.rounds, args.tokens))
    else:
        # Rounds alternate between the two checkouts, each in a fresh process, so both see
        # the same machine.
        other = Path(args.baseline).resolve()
        for _ in range(args.rounds):
            for into, python, cwd in (
                (base, str(other / ".venv" / "bin" / "python"), other),
                (mine, sys.executable, ROOT),
            ):
                for key, values in _one_round(python, cwd, args).items():
                    into.setdefault(key, []).extend(values)
    print(
        f"\ninference core CPU per request (us, median of {args.rounds} rounds of "
        f"{args.requests}; {args.tokens}-token plain answers, one token per stream chunk)\n"
    )
    if base:
        there = _git_commit(Path(args.baseline))
        print(f"| row | {there} us | {here} us | {here} / {there} |")
        print("| --- | ---: | ---: | ---: |")
    else:
        print(f"| row | {here} us |")
        print("| --- | ---: |")
    for key, values in mine.items():
        now = statistics.median(values)
        if base:
            then = statistics.median(base[key])
            print(f"| {key} | {then:,.0f} | {now:,.0f} | {now / then:.2f} |")
        else:
            print(f"| {key} | {now:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
