"""Cost of the canonical form and chained hashes of chat messages (areal_runtime.openai.messages).

    uv run python benchmarks/message_hash.py [--turns 100] [--repeat 5]

The proxy's lineage hashes a turn's new messages (all of them when the turn does not extend
the session's latest one), and the gateway's cache-aware routing hashes the prefixes of every
request: both call `canonical()` once per message. An agent conversation of `--turns` turns
is built here (a system prompt, a user task, then per turn an assistant message with a tool
call whose arguments are a small JSON object, a file-writing call with a long string argument
every fifth turn, and the tool's result), and timed three ways, best of `--repeat`:

* `canonical()` of every message, per message (by kind: plain text, tool call, tool result);
* `prefix_hashes()` of the whole conversation (the gateway's per-request cost, and the
  lineage's when a turn does not extend the latest one), per request;
* the same conversation echoed back the way JavaScript harnesses echo it (arguments
  re-serialized as compact JSON): whether its hashes equal the original's.

It touches nothing but the function, so the same script measures any version of it.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from collections.abc import Callable
from typing import Any

from areal_runtime.openai.messages import canonical, prefix_hashes


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(n)
    )


def conversation(turns: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": _words(rng, 400)},
        {"role": "user", "content": _words(rng, 60)},
    ]
    for i in range(turns):
        if i % 5 == 4:
            args: dict[str, Any] = {"path": f"src/mod_{i}.py", "content": _words(rng, 300)}
            name = "write"
        else:
            args = {"command": _words(rng, 6), "timeout": 30, "workdir": "/repo", "env": {}}
            name = "bash"
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        msgs.append({"role": "assistant", "content": _words(rng, 12), "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": _words(rng, 80)})
    return msgs


def echoed(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`msgs` as a JavaScript harness sends them back: arguments as compact JSON."""
    out = []
    for m in msgs:
        if m.get("tool_calls"):
            calls = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(
                            json.loads(c["function"]["arguments"]), separators=(",", ":")
                        ),
                    },
                }
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def best(fn: Callable[[], object], repeat: int, number: int) -> float:
    """Best seconds per call of `fn` over `repeat` rounds of `number` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    msgs = conversation(args.turns)
    kinds = {
        "text (system, user)": [m for m in msgs if m["role"] in ("system", "user")],
        "assistant with a tool call": [m for m in msgs if m.get("tool_calls")],
        "tool result": [m for m in msgs if m["role"] == "tool"],
    }
    print(f"{len(msgs)} messages, {len(json.dumps(msgs)) / 1e3:.0f} kB as JSON")
    for kind, group in kinds.items():

        def each(group: list[dict[str, Any]] = group) -> None:
            for m in group:
                canonical(m)

        per = best(each, args.repeat, 200) / len(group)
        print(f"canonical(), {kind}: {per * 1e6:.2f} us per message")
    whole = best(lambda: prefix_hashes(msgs), args.repeat, 50)
    print(f"prefix_hashes() of the conversation: {whole * 1e3:.3f} ms per request")
    same = prefix_hashes(echoed(msgs)) == prefix_hashes(msgs)
    print(f"compact-JSON echo hashes as the original: {same}")


if __name__ == "__main__":
    main()
