"""CPU per turn of long RL sessions with big messages: does a turn cost the proxy its new
message, or the whole conversation again?

    uv run python benchmarks/long_session.py [--turns 100] [--parallel 8] [--chars 4000] \
        [--templates hf,concat] [--modes single,parallel]

A real router, gateway and one data proxy (tests/e2e/stack.py, the code the CLI uses;
`--context-length 1000000`, log level warning) in front of the *zero-cost fake engine*
(benchmarks/fake_engine.py, 16 tokens per answer), so everything measured is areal's own.
Each session has its own RL session key (`POST /rl/start_session`) and one conversation of
`--turns` turns through `POST /v1/chat/completions` (non-stream): turn k sends the system
prompt, every earlier user message and the answer the gateway returned (echoed back as an
assistant message), and a new user message of `--chars` characters of random words (seeded,
different per turn and per session).

Per template (`--chat-template-type hf` or `concat`), each mode on a fresh stack:

* single: one session; per bucket of 10 turns the prompt tokens at the bucket's last turn
  (usage.prompt_tokens), the request body, the turns' latency p50, the CPU per turn of the
  proxy (its whole process group, children such as the prompt screen included, reaped ones
  through cutime/cstime) and of the gateway, from /proc/<pid>/stat; and the *floor*: this
  process rendering the last turn's conversation with the model's chat template (jinja2,
  as Hugging Face does) and tokenizing it once, whole, with `tokenizers` (`encode_batch_fast`,
  no offsets: the cheapest way; best of 3).
* parallel: `--parallel` sessions side by side (one thread each, each its own httpx client),
  meeting at a barrier after each bucket so the bucket's CPU is theirs alone; per bucket the
  latency p50/p90 across sessions, turns/s and proxy/gateway CPU per turn; then the turns/s
  of the whole run (the floor's own time, taken at the barriers, left out).

After each mode, the proxy's RSS (VmRSS summed over its process group). It relies only on
HTTP APIs and pids, so the same script measures any version of the proxy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from stack import launch, metric, start_stack  # noqa: E402

from areal_cli import supervisor  # noqa: E402

MODEL_DIR = ROOT / "models" / "tiny-parrot"
BUCKET = 10
SYSTEM = "You are a helpful assistant. Answer briefly."
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- /proc


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a component is its group's leader)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (f := _stat(int(name))) is not None and int(f[2]) == pgid:
            pids.append(int(name))
    return pids


def group_cpu(pgid: int) -> float:
    """Seconds of CPU of a process group: each member's utime + stime, plus cutime + cstime
    (children it reaped: a screen child stopped while idle still counts)."""
    total = 0
    for pid in group_pids(pgid):
        if (f := _stat(pid)) is not None:
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / TICK


def busy_s() -> float:
    """Seconds of CPU the whole machine has been busy (every core, idle and iowait left out)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK


class Others:
    """CPU used by processes this benchmark did not start (a shared machine), per bucket:
    the machine's busy time less the stack's, the engine's and this process's."""

    def __init__(self, pgids: list[int]) -> None:
        self.pgids = pgids
        self.shares: list[float] = []
        self.start()

    def _ours(self) -> float:
        me = _stat(os.getpid()) or ["0"] * 15
        return sum(group_cpu(g) for g in self.pgids) + (int(me[11]) + int(me[12])) / TICK

    def start(self) -> None:
        self.t, self.busy, self.ours = time.perf_counter(), busy_s(), self._ours()

    def bucket(self) -> None:
        t, busy, ours = time.perf_counter(), busy_s(), self._ours()
        self.shares.append(max(0.0, (busy - self.busy) - (ours - self.ours)) / (t - self.t))
        self.start()

    def line(self, template: str, mode: str) -> str:
        if not self.shares:
            return ""
        return (
            f"other processes on the machine during {template}/{mode}: "
            f"{statistics.mean(self.shares) * 100:.0f}% of a core on average, "
            f"{max(self.shares) * 100:.0f}% in the busiest bucket (~0-10% = quiet)"
        )


def group_rss_mb(pgid: int) -> tuple[float, int]:
    """VmRSS summed over a process group (MB), and how many processes it has."""
    kb, pids = 0, group_pids(pgid)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        kb += int(line.split()[1])
        except FileNotFoundError:
            pass
    return kb / 1024, len(pids)


# ---------------------------------------------------------------- the conversation


class Words:
    """`--chars` characters of random words, the same for the same (session, turn)."""

    def __init__(self, chars: int) -> None:
        rnd = random.Random(0)
        self.pool = [
            "".join(rnd.choices(string.ascii_lowercase, k=rnd.randint(2, 9))) for _ in range(5000)
        ]
        self.chars = chars

    def message(self, session: int, turn: int) -> str:
        rnd = random.Random(f"long-session {session} {turn}")
        words = rnd.choices(self.pool, k=self.chars // 3)
        return " ".join(words)[: self.chars]


class Floor:
    """Render the conversation with the model's template (as Hugging Face does) and time
    tokenizing it once, whole."""

    def __init__(self, model_dir: Path) -> None:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        source = cfg.get("chat_template") or (model_dir / "chat_template.jinja").read_text()
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.special = {
            "bos_token": cfg.get("bos_token") or "",
            "eos_token": cfg.get("eos_token") or "",
        }
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        # The fastest whole encode the library has: no offsets (`encode` with offsets takes
        # ~1.7x as long on these prompts); a batch of one runs on one thread.
        self.encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)

    def measure(self, messages: list[dict]) -> tuple[float, float, int]:
        """(render ms, tokenize ms, tokens), each time the best of 3."""
        renders, encodes = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            text = self.template.render(
                messages=messages, tools=None, add_generation_prompt=True, **self.special
            )
            t1 = time.perf_counter()
            ids = self.encode([text], add_special_tokens=False)[0].ids
            renders.append(t1 - t0)
            encodes.append(time.perf_counter() - t1)
        return min(renders) * 1e3, min(encodes) * 1e3, len(ids)


def _raise(message: str) -> None:
    raise ValueError(message)


@dataclass
class Session:
    index: int
    key: str
    words: Words
    gateway: str
    messages: list[dict] = field(default_factory=lambda: [{"role": "system", "content": SYSTEM}])

    def __post_init__(self) -> None:
        self.http = httpx.Client(
            base_url=self.gateway,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
            timeout=httpx.Timeout(600, connect=10),
        )

    def turn(self, k: int) -> tuple[float, int, int]:
        """Turn k (1-based): (latency s, prompt tokens, body bytes)."""
        self.messages.append({"role": "user", "content": self.words.message(self.index, k)})
        body = orjson.dumps({"model": "tiny-parrot", "messages": self.messages, "max_tokens": 16})
        t0 = time.perf_counter()
        r = self.http.post("/v1/chat/completions", content=body)
        lat = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(
                f"session {self.index} turn {k}: HTTP {r.status_code} {r.text[:300]}"
            )
        out = orjson.loads(r.content)
        content = out["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": content})
        return lat, int(out["usage"]["prompt_tokens"]), len(body)

    def close(self) -> None:
        self.http.close()


# ---------------------------------------------------------------- one stack per mode


def new_stack(tmp: Path, engine_url: str, template: str, mode: str):
    return start_stack(
        tmp / f"{template}-{mode}",
        engine_url,
        MODEL_DIR,
        n_proxies=1,
        gateway_args=["--log-level", "warning"],
        proxy_args=[
            "--log-level",
            "warning",
            "--chat-template-type",
            template,
            "--context-length",
            "1000000",
        ],
        router_args=["--log-level", "warning"],
    )


def sessions_for(stack, n: int, words: Words, tag: str) -> list[Session]:
    out = []
    with stack.admin() as admin:
        for i in range(n):
            r = admin.post("/rl/start_session", json={"task_id": f"{tag}-{i}", "group_size": 1})
            if r.status_code != 201:
                raise RuntimeError(f"start_session: HTTP {r.status_code} {r.text[:300]}")
            key = r.json()["sessions"][0]["session_api_key"]
            out.append(Session(i, key, words, stack.gateway_url))
    return out


def buckets(turns: int) -> list[tuple[int, int]]:
    return [(a, min(a + BUCKET - 1, turns)) for a in range(1, turns + 1, BUCKET)]


def rss_line(template: str, mode: str, pgid: int, stack, rss0: float, sessions: int) -> str:
    """The proxy's RSS after the mode, its growth since the stack started (per session), and
    the proxy's own estimate of its turn cache (areal_proxy_prompt_cache_bytes; n/a on a
    proxy without one)."""
    mb, n = group_rss_mb(pgid)
    try:
        proxy = stack.proxies[0]
        cache = metric(proxy, "areal_proxy_prompt_cache_bytes") / 2**20
        tokenized = metric(proxy, "areal_proxy_prompt_tokenized_tokens_total")
        builds = metric(proxy, "areal_proxy_prompt_builds_total")
        cached = (
            f"; turn cache estimate {cache:,.1f} MB; prompt ids tokenized per turn "
            f"{tokenized / max(builds, 1):,.0f} (the rest continued)"
        )
    except (httpx.HTTPError, KeyError, ValueError):
        cached = ""
    grown = mb - rss0
    return (
        f"proxy RSS after {template}/{mode}: {mb:,.0f} MB ({n} process(es) in its group), "
        f"{grown:+,.0f} MB since start, {grown / sessions:,.1f} MB per session{cached}"
    )


def run_single(tmp, engine_url, engine_pid, template, args, words, floor) -> list[str]:
    stack = new_stack(tmp, engine_url, template, "single")
    lines = [
        f"### {template}, single session, {args.turns} turns, {args.chars:,}-char user messages",
        "",
        "| turns | prompt tokens (k) | body kB | p50 ms | proxy CPU ms/turn "
        "| gateway CPU ms/turn | client CPU ms/turn | render ms | floor ms (tokenize whole once) "
        "| floor tokens (k) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for line in lines:
        print(line, flush=True)
    try:
        proxy, gw = stack.proxies[0].popen.pid, stack.gateway.popen.pid
        rss0 = group_rss_mb(proxy)[0]
        (s,) = sessions_for(stack, 1, words, f"single-{template}")
        others = Others([proxy, gw, stack.router.popen.pid, engine_pid])
        try:
            for a, b in buckets(args.turns):
                others.start()
                p0, g0, c0 = group_cpu(proxy), group_cpu(gw), time.process_time()
                lat = []
                for k in range(a, b + 1):
                    t, ptok, body = s.turn(k)
                    lat.append(t)
                p1, g1, c1 = group_cpu(proxy), group_cpu(gw), time.process_time()
                others.bucket()
                n = b - a + 1
                render_ms, floor_ms, ftok = floor.measure(s.messages[:-1])
                row = (
                    f"| {a}-{b} | {ptok / 1e3:.1f} | {body / 1e3:.0f} "
                    f"| {statistics.median(lat) * 1e3:.1f} | {(p1 - p0) / n * 1e3:.1f} "
                    f"| {(g1 - g0) / n * 1e3:.1f} | {(c1 - c0) / n * 1e3:.1f} "
                    f"| {render_ms:.1f} | {floor_ms:.1f} | {ftok / 1e3:.1f} |"
                )
                lines.append(row)
                print(row, flush=True)
        finally:
            s.close()
        lines += [
            "",
            rss_line(template, "single", proxy, stack, rss0, 1),
            others.line(template, "single"),
        ]
        print("\n".join(lines[-2:]), flush=True)
    finally:
        stack.stop()
    return lines


def run_parallel(tmp, engine_url, engine_pid, template, args, words, floor) -> list[str]:
    stack = new_stack(tmp, engine_url, template, "parallel")
    n_s = args.parallel
    lines = [
        f"### {template}, {n_s} sessions side by side, {args.turns} turns each, "
        f"{args.chars:,}-char user messages",
        "",
        "| turns | prompt tokens (k) | body kB | p50 ms | p90 ms | turns/s "
        "| proxy CPU ms/turn | proxy CPU % of a core | gateway CPU ms/turn "
        "| floor ms (tokenize whole once) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for line in lines:
        print(line, flush=True)
    try:
        proxy, gw = stack.proxies[0].popen.pid, stack.gateway.popen.pid
        rss0 = group_rss_mb(proxy)[0]
        sessions = sessions_for(stack, n_s, words, f"parallel-{template}")
        others = Others([proxy, gw, stack.router.popen.pid, engine_pid])
        plan = buckets(args.turns)
        lat: list[list[float]] = [[] for _ in plan]
        last: dict[int, tuple[int, int]] = {}
        errors: list[BaseException] = []
        mark = {"i": 0, "t": 0.0, "p": 0.0, "g": 0.0, "floor_s": 0.0}
        run_t0 = [0.0]

        def sample() -> None:
            mark["t"] = time.perf_counter()
            mark["p"], mark["g"] = group_cpu(proxy), group_cpu(gw)
            others.start()

        def at_barrier() -> None:
            # One thread runs this while the others wait: the bucket's figures, the floor
            # (its time left out of turns/s), and the next bucket's start.
            i = mark["i"]
            t1, p1, g1 = time.perf_counter(), group_cpu(proxy), group_cpu(gw)
            others.bucket()
            if errors:
                return
            a, b = plan[i]
            n = (b - a + 1) * n_s
            f0 = time.perf_counter()
            _, floor_ms, _ = floor.measure(sessions[0].messages[:-1])
            mark["floor_s"] += time.perf_counter() - f0
            wall = t1 - mark["t"]
            ptok, body = last[0]
            q = statistics.quantiles(lat[i], n=10, method="inclusive")
            row = (
                f"| {a}-{b} | {ptok / 1e3:.1f} | {body / 1e3:.0f} "
                f"| {statistics.median(lat[i]) * 1e3:.1f} | {q[8] * 1e3:.1f} "
                f"| {n / wall:.1f} | {(p1 - mark['p']) / n * 1e3:.1f} "
                f"| {(p1 - mark['p']) / wall * 100:.0f} | {(g1 - mark['g']) / n * 1e3:.1f} "
                f"| {floor_ms:.1f} |"
            )
            lines.append(row)
            print(row, flush=True)
            mark["i"] = i + 1
            sample()

        barrier = threading.Barrier(n_s, action=at_barrier)
        lock = threading.Lock()

        def worker(s: Session) -> None:
            try:
                for i, (a, b) in enumerate(plan):
                    for k in range(a, b + 1):
                        t, ptok, body = s.turn(k)
                        with lock:
                            lat[i].append(t)
                        last[s.index] = (ptok, body)
                    barrier.wait()
            except threading.BrokenBarrierError:
                pass
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in sessions]
        try:
            run_t0[0] = time.perf_counter()
            sample()
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        except BaseException:
            barrier.abort()
            raise
        finally:
            for s in sessions:
                s.close()
        if errors:
            raise errors[0]
        total = time.perf_counter() - run_t0[0] - mark["floor_s"]
        lines += [
            "",
            f"{template}/parallel: {args.turns * n_s} turns in {total:.1f} s: "
            f"**{args.turns * n_s / total:.2f} turns/s** over the whole run",
            rss_line(template, "parallel", proxy, stack, rss0, args.parallel),
            others.line(template, "parallel"),
        ]
        print("\n".join(lines[-4:]), flush=True)
    finally:
        stack.stop()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--templates", default="hf,concat")
    ap.add_argument("--modes", default="single,parallel")
    ap.add_argument("--chars", type=int, default=4000)
    args = ap.parse_args()
    modes = args.modes.split(",")
    bad = set(modes) - {"single", "parallel"}
    if bad:
        ap.error(f"unknown mode(s): {', '.join(sorted(bad))}")
    started = time.perf_counter()
    words, floor = Words(args.chars), Floor(MODEL_DIR)
    tmp = Path(tempfile.mkdtemp(prefix="areal-long-session-"))
    print(
        f"long sessions through the gateway: zero-cost fake engine (16 tokens per answer), "
        f"one data proxy (--context-length 1000000), model {MODEL_DIR.name}; "
        f"{os.cpu_count()} CPUs; logs in {tmp}\n",
        flush=True,
    )
    engine = launch(
        "fake-engine", [sys.executable, str(ROOT / "benchmarks" / "fake_engine.py")], tmp, {}
    )
    url = f"http://127.0.0.1:{engine.info['port']}"
    try:
        for template in args.templates.split(","):
            for mode in modes:
                run = run_single if mode == "single" else run_parallel
                run(tmp, url, engine.popen.pid, template, args, words, floor)
                print(flush=True)
    finally:
        supervisor.terminate([[engine.comp]], grace=2, procs={engine.popen.pid: engine.popen})
    print(f"total wall time: {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
