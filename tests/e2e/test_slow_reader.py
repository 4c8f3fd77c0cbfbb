"""Backpressure end to end: a client that stops reading its streamed answer holds back only
its own request (real router, gateway and data proxy, real SGLang engine on the CPU).

One proxy, so every request shares its one multiplexed `Generate` stream (docs/services.md,
"Multiplexed generation"). A raw-socket client asks for a long streamed chat answer, reads
its first events and then reads nothing: its socket buffers fill, the gateway's write to it
blocks, the gateway stops returning credit, and the proxy queues that request's results up
to `QUEUE_LIMIT` and then stops reading its engine stream. Meanwhile ordinary requests (the
official `openai` SDK) go through the same gateway and stream in about their usual time; the
proxy's held-results gauge never passes the bound; once the client reads again its answer
arrives whole, and the RL session's export has exactly the tokens that were streamed.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest
from stack import ADMIN_KEY, Stack, metric, start_stack
from testpaths import PARROT
from tokenizers import Tokenizer

from areal_proxy.serving.multiplex import QUEUE_LIMIT

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"

HELD = "areal_proxy_stream_held_results"
WAITS = "areal_proxy_stream_credit_waits_total"

# The stalled answer: every token is one SSE event of about 1.4 kB (20 top logprobs each),
# ~1.4 MB in all, many times what the kernel and the gateway's transport buffer before the
# gateway's writes block (see `SlowReader`). The parrot always runs to max_tokens; the
# engine's context is 2048 tokens. (SGLang itself keeps generating while the proxy does not
# read, and keeps the rest of the answer in its own process; what is bounded is areal's.)
STALLED_TOKENS = 1000
TOP_LOGPROBS = 20
FAST_TOKENS = 16
# A request that waits behind the stalled one would wait until the stalled client reads
# (never, here); one that is merely slowed by a loaded 2-core machine stays far inside this.
SLOWDOWN_FACTOR = 10
SLOWDOWN_SLACK_S = 5.0
# Patience on a loaded machine (a busy CPU engine may make only ~15 tokens/s).
STALL_WITHIN_S = 180.0
FAST_TIMEOUT_S = 180.0
REST_WITHIN_S = 600.0


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("slow-reader"), sglang_engine.url, PARROT, n_proxies=1)
    yield s
    s.stop()


class SlowReader:
    """An HTTP/1.1 client on a raw socket that reads only when told to.

    Its receive buffer is small (SO_RCVBUF), and so is the segment size it announces
    (TCP_MAXSEG): Linux sizes the sending side's buffer from the peer's segment size (about
    2 x 10 segments' worth of memory), which on loopback (64 kB segments) would be ~2.6 MB,
    enough to swallow the whole answer; with 1 kB segments it is ~46 kB.
    """

    def __init__(self, stack: Stack, path: str, body: dict, key: str) -> None:
        host, port = stack.gateway.info["host"], stack.gateway.info["port"]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1024)
        self.sock.settimeout(30)
        self.sock.connect((host, port))
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        )
        self.sock.sendall(head.encode() + data)
        self.raw = b""
        self.eof = False

    def read_until(self, done, within: float) -> None:
        deadline = time.monotonic() + within
        while not done():
            assert not self.eof, f"the stream ended early: {self.raw[-500:]!r}"
            assert time.monotonic() < deadline, f"nothing more after {within} s"
            chunk = self.sock.recv(4096)
            if not chunk:
                self.eof = True
            self.raw += chunk

    def head(self) -> tuple[int, dict[str, str]]:
        head = self.raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        fields = (line.partition(":") for line in head[1:])
        return status, {k.strip().lower(): v.strip() for k, _, v in fields}

    def events(self) -> list[str]:
        """The SSE events of the whole response (read to the end)."""
        _, headers = self.head()
        body = self.raw.partition(b"\r\n\r\n")[2]
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = dechunk(body)
        return [e for e in body.decode().split("\n\n") if e.strip()]

    def close(self) -> None:
        self.sock.close()


def dechunk(body: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[j + 2 : j + 2 + size])
        assert body[j + 2 + size : j + 4 + size] == b"\r\n", "bad chunk framing"
        i = j + 4 + size


class Sampler(threading.Thread):
    """Reads the proxy's held-results gauge every 50 ms until stopped."""

    def __init__(self, proxy) -> None:
        super().__init__(daemon=True)
        self.proxy = proxy
        self.samples: list[float] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append(metric(self.proxy, HELD))
            self.halt.wait(0.05)

    def stop(self) -> list[float]:
        self.halt.set()
        self.join(30)
        return self.samples


def wait_until(cond, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        time.sleep(0.1)


def fast_requests(sdk: openai.OpenAI) -> dict[str, float]:
    """One streamed chat and one whole completion; the seconds each took."""
    took = {}
    t0 = time.monotonic()
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "quick"}],
        max_tokens=FAST_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage, finish = None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
    took["chat stream"] = time.monotonic() - t0
    assert finish == "length" and usage is not None and usage.completion_tokens == FAST_TOKENS

    t0 = time.monotonic()
    r = sdk.completions.create(model=MODEL, prompt="quick", max_tokens=FAST_TOKENS, temperature=0)
    took["completion"] = time.monotonic() - t0
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == FAST_TOKENS
    return took


def test_a_stalled_reader_holds_back_only_its_own_request(stack):
    proxy = stack.proxies[0]
    sdk = openai.OpenAI(
        base_url=stack.gateway_url + "/v1",
        api_key=ADMIN_KEY,
        max_retries=0,
        timeout=FAST_TIMEOUT_S,
    )
    fast_requests(sdk)  # warm up (the first request also opens the Generate stream)
    runs = [fast_requests(sdk) for _ in range(2)]
    baseline = {k: max(r[k] for r in runs) for k in runs[0]}
    assert metric(proxy, HELD) == 0
    waits_before = metric(proxy, WAITS)

    with stack.admin() as c:
        r = c.post("/rl/start_session", json={"task_id": "slow-reader", "group_size": 1})
    assert r.status_code == 201, r.text
    [session] = r.json()["sessions"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer, please"}],
        "max_tokens": STALLED_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": TOP_LOGPROBS,
    }
    reader = SlowReader(stack, "/v1/chat/completions", body, session["session_api_key"])
    try:
        # The headers and the first few events, then the client reads nothing.
        reader.read_until(lambda: reader.raw.count(b"data: ") >= 3, FAST_TIMEOUT_S)
        status, headers = reader.head()
        assert status == 200 and headers["content-type"].startswith("text/event-stream")

        sampler = Sampler(proxy)
        sampler.start()
        try:
            # The stall reaches the proxy: the request's queue fills up without credit.
            wait_until(
                lambda: bool(sampler.samples) and sampler.samples[-1] >= QUEUE_LIMIT,
                STALL_WITHIN_S,
                "the stalled request's results never piled up at the proxy",
            )
            stalled = [fast_requests(sdk) for _ in range(2)]
            # ...and it is still stalled: the requests above ran while it was held.
            assert metric(proxy, HELD) == QUEUE_LIMIT
        finally:
            samples = sampler.stop()
        waits = metric(proxy, WAITS) - waits_before
        print(
            f"held max {max(samples)} over {len(samples)} samples, credit waits {waits}, "
            f"baseline {baseline}, while stalled {stalled}"
        )
        # Bounded: at most QUEUE_LIMIT results held, all the while; the bound was reached
        # and the request's task waited at it (it stopped reading its engine stream).
        assert max(samples) <= QUEUE_LIMIT, samples
        assert max(samples) == QUEUE_LIMIT
        assert waits > 0
        for run in stalled:
            for kind, seconds in run.items():
                limit = SLOWDOWN_FACTOR * baseline[kind] + SLOWDOWN_SLACK_S
                assert seconds <= limit, (kind, seconds, baseline[kind])

        # The client reads again: the whole answer arrives, in order, nothing lost.
        reader.read_until(lambda: reader.eof, REST_WITHIN_S)
        events = reader.events()
    finally:
        reader.close()
    assert all(e.startswith("data: ") for e in events), [e[:80] for e in events[:3]]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    tokens, text, finish, usage = [], [], None, None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
            tokens += (choice.get("logprobs") or {}).get("content") or []
            finish = choice.get("finish_reason") or finish
    assert len(tokens) == STALLED_TOKENS
    assert all(len(t["top_logprobs"]) == TOP_LOGPROBS for t in tokens)
    assert "".join(t["token"] for t in tokens) == "".join(text)
    assert finish == "length"
    assert usage is not None and usage["completion_tokens"] == STALLED_TOKENS
    assert metric(proxy, HELD) == 0

    # What the session recorded is what was streamed, token for token.
    with stack.admin() as c:
        r = c.post("/rl/export_trajectories", json={"session_ids": [session["session_id"]]})
    assert r.status_code == 200, r.text
    [row] = r.json()["rows"]
    out = [i for i, m in enumerate(row["loss_mask"]) if m]
    assert len(out) == STALLED_TOKENS
    assert [row["logprobs"][i] for i in out] == pytest.approx(
        [t["logprob"] for t in tokens], abs=1e-4
    )
    tok = Tokenizer.from_file(str(PARROT / "tokenizer.json"))
    assert tok.decode([row["input_ids"][i] for i in out], skip_special_tokens=False) == "".join(
        text
    )
