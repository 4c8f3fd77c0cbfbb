"""Does areal_runtime.bodycost's estimate follow what parsing a body really costs?

    uv run python benchmarks/body_cost.py [--mb 7]

Bodies of one size and different shapes (prose, empty objects, empty lists, token ids, small
strings, chat messages, nested objects), and a long agent session's 410 kB body: per body the
real `orjson.loads` (best of 5, the collector on, as in the services), the estimate
(`cost_ns`), what counting costs, and the services' decision (inline, screened, refused).
"""

from __future__ import annotations

import argparse
import random
import string
import time

import orjson

from areal_runtime import bodycost


def _best_ms(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def bodies(size: int) -> dict[str, bytes]:
    rnd = random.Random(0)
    words = ["".join(rnd.choices(string.ascii_lowercase, k=rnd.randint(2, 9))) for _ in range(5000)]
    text = " ".join(rnd.choices(words, k=size // 5))[:size]
    session = [{"role": "system", "content": "You are helpful."}]
    for _ in range(100):
        session.append({"role": "user", "content": " ".join(rnd.choices(words, k=700))[:4000]})
        session.append({"role": "assistant", "content": "ok " * 10})
    return {
        "prose": orjson.dumps({"messages": [{"role": "user", "content": text}]}),
        "empty objects": orjson.dumps({"metadata": {"pad": [{}] * (size // 3)}}),
        "empty lists": orjson.dumps({"metadata": {"pad": [[]] * (size // 3)}}),
        "token ids": orjson.dumps({"prompt": [rnd.randrange(50_000) for _ in range(size // 6)]}),
        "small strings": orjson.dumps({"x": ["a"] * (size // 4)}),
        "chat messages": orjson.dumps(
            {"messages": [{"role": "user", "content": "hi"}] * (size // 30)}
        ),
        "nested objects": orjson.dumps({"x": [{"a": {"b": [1]}}] * (size // 17)}),
        "410 kB session": orjson.dumps({"model": "m", "messages": session}),
    }


def decision(body: bytes) -> str:
    if bodycost.parses_inline(body):
        return "inline"
    return "refused" if bodycost.too_complex(body) is not None else "screened"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=7.0)
    a = p.parse_args()
    print(
        "| body | size MB | orjson.loads ms | estimate ms | estimate / real | count ms | decision |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, body in bodies(int(a.mb * 1_000_000)).items():
        real = _best_ms(lambda b=body: orjson.loads(b))
        est = bodycost.cost_ns(body) / 1e6
        count = _best_ms(lambda b=body: bodycost.counts(b))
        print(
            f"| {name} | {len(body) / 1e6:.2f} | {real:.2f} | {est:.2f} | {est / real:.1f} "
            f"| {count:.2f} | {decision(body)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
