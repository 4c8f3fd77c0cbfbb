"""A zero-cost SGLang-compatible engine, for measuring areal's own overhead only.

    python benchmarks/fake_engine.py --port 0 --tokens 16 --ready-file PATH

It answers `GET /health` and `POST /generate` (SGLang's native shape, stream
and not) instantly: every output token is the last prompt token, logprob 0.
It also answers OpenAI's `POST /v1/chat/completions` (stream and not, `max_tokens`
tokens of content, at most `--tokens`; the answers are made once per shape and
kept as bytes), and what a router probes a SGLang worker with before it routes to
it (`/health_generate`, `/v1/models` with the one model `--model-id`,
`/server_info`, `/model_info` and their `get_` aliases, `/v1/loads`, `/metrics`):
SMG (benchmarks/vs_smg.py) takes it as a worker.
Streams are written in one go unless paced: `--token-interval-ms N` (or
`POST /fake_config {"token_interval_ms": N}` at run time) sends one token every
N ms, as a real engine decoding one token per step does; `--stream-interval K` sends K
tokens per event, K steps apart, as SGLang's `--stream-interval K` does.
`POST /update_weights_from_disk` succeeds at once (benchmarks/admission_load.py updates
weights under load).
It never stands in for a real engine in a test of a feature; benchmarks name
it as "zero-cost fake engine" in their output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

try:
    import orjson

    dumps = orjson.dumps
    # A long session's request carries hundreds of thousands of ids: the stdlib parser took
    # ~20 ms for 340k of them, orjson ~2 ms (a real engine's cost is its own business here).
    loads = orjson.loads
except ImportError:  # pragma: no cover

    def dumps(o):  # type: ignore[misc]
        return json.dumps(o).encode()

    loads = json.loads


_IDS = b'"input_ids":['


def _request(body: bytes) -> tuple[dict, int, int]:
    """The request, its prompt's length and last id (all the answers need of the ids):
    a long session's request carries hundreds of thousands of them, and parsing them all
    (~2 ms with orjson for 340k, ~20 ms with the stdlib) would be this engine's cost, not
    areal's. The ids are counted (commas) and only the last one is read."""
    start = body.find(_IDS)
    if start < 0:
        req = loads(body)
        ids = req.get("input_ids") or [0]
        return req, len(ids), ids[-1]
    start += len(_IDS)
    end = body.index(b"]", start)
    req = loads(body[: start - 1] + b"[]" + body[end + 1 :])
    if end == start:
        return req, 1, 0
    count = body.count(b",", start, end) + 1
    return req, count, int(body[body.rfind(b",", start, end) + 1 : end])


def _info(model: str) -> dict[bytes, tuple[bytes, bytes]]:
    """GET answers a router probes a SGLang worker with (SMG's discovery and load polls)."""
    j = b"application/json"
    models = {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": 0,
                "owned_by": "sglang",
                "root": model,
                "max_model_len": 32768,
            }
        ],
    }
    model_info = {
        "model_path": model,
        "tokenizer_path": model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "fake",
        "architectures": ["FakeForCausalLM"],
    }
    server_info = {
        "model_path": model,
        "tokenizer_path": model,
        "served_model_name": model,
        "context_length": 32768,
        "dp_size": 1,
        "tp_size": 1,
        "max_total_num_tokens": 1_000_000,
        "version": "fake",
        "internal_states": [{"last_gen_throughput": 0.0}],
    }
    loads = {
        "timestamp": "",
        "dp_rank_count": 1,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": 0,
                "num_waiting_reqs": 0,
                "num_waiting_uncached_tokens": 0,
                "num_total_reqs": 0,
                "num_used_tokens": 0,
                "max_total_num_tokens": 1_000_000,
                "token_usage": 0.0,
                "gen_throughput": 0.0,
                "cache_hit_rate": 0.0,
                "utilization": 0.0,
                "max_running_requests": 0,
            }
        ],
    }
    out = {
        b"/v1/models": (dumps(models), j),
        b"/model_info": (dumps(model_info), j),
        b"/get_model_info": (dumps(model_info), j),
        b"/server_info": (dumps(server_info), j),
        b"/get_server_info": (dumps(server_info), j),
        b"/v1/loads": (dumps(loads), j),
        b"/get_loads": (dumps(loads), j),
        b"/loads": (dumps(loads), j),
        b"/metrics": (b"", b"text/plain; version=0.0.4"),
    }
    return out


def _chat(model: str, n: int, stream: bool, usage: bool, step: int = 1) -> list[bytes]:
    """A chat completion of n tokens of content (" hi" each): the body, or a stream's
    events (one chunk per `step` tokens, the chunk with finish_reason, the usage chunk if
    asked, [DONE])."""
    head = {"id": "chatcmpl-fake", "created": 0, "model": model}
    use = {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n}
    if not stream:
        body = {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " hi" * n},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": use,
        }
        return [dumps(body)]
    chunk = {**head, "object": "chat.completion.chunk"}
    events = []
    for i in range(0, n, step):
        text = " hi" * min(step, n - i)
        delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        ev = {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        events.append(b"data: " + dumps(ev) + b"\n\n")
    end = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    events.append(b"data: " + dumps(end) + b"\n\n")
    if usage:
        events.append(b"data: " + dumps({**chunk, "choices": [], "usage": use}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


class _Engine(asyncio.Protocol):
    tokens = 16
    interval_s = 0.0
    stream_interval = 1
    model = "tiny-parrot"
    info: dict[bytes, tuple[bytes, bytes]] = {}
    chats: dict[tuple[int, bool, bool], list[bytes]] = {}

    def connection_made(self, transport):
        self.t = transport
        self.buf = bytearray()

    def data_received(self, data):
        # A bytearray grows in place: `bytes +=` copied a 2 MB body once per 64 kB read.
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            lines = head.split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for ln in lines[1:]:
                k, _, v = ln.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(self.buf) < head_end + 4 + length:
                return
            body = bytes(self.buf[head_end + 4 : head_end + 4 + length])
            del self.buf[: head_end + 4 + length]
            self.handle(method, path, body)

    def reply(self, status, body, ctype=b"application/json"):
        self.t.write(
            b"HTTP/1.1 "
            + status
            + b"\r\nContent-Type: "
            + ctype
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    def handle(self, method, path, body):
        if path == "/health" or path == "/health_generate":
            return self.reply(b"200 OK", b"{}")
        if path == "/fake_config":
            _Engine.interval_s = float(json.loads(body).get("token_interval_ms", 0)) / 1000
            return self.reply(b"200 OK", b'{"status":"ok"}')
        if path in ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache"):
            return self.reply(b"200 OK", b'{"status":"ok"}')
        if path == "/update_weights_from_disk":
            # Weights "load" at once: a weight update through areal costs only areal's part.
            return self.reply(b"200 OK", b'{"success":true,"message":"fake engine"}')
        if path == "/v1/chat/completions":
            return self.chat(body)
        if method == "GET":
            known = self.info.get(path.split("?", 1)[0].encode())
            if known is not None:
                return self.reply(b"200 OK", known[0], known[1])
        if path != "/generate":
            return self.reply(b"404 Not Found", b'{"error":"not found"}')
        req, n_prompt, tok = _request(body)
        n = min(int(req.get("sampling_params", {}).get("max_new_tokens", self.tokens)), self.tokens)
        if not req.get("stream"):
            out = {
                "text": "",
                "output_ids": [tok] * n,
                "meta_info": {
                    "id": req.get("rid") or "fake",
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n,
                    "finish_reason": {"type": "length", "length": n},
                    "weight_version": "default",
                    "output_token_logprobs": [[0.0, tok, None]] * n,
                },
            }
            return self.reply(b"200 OK", dumps(out))
        self.t.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        events = []
        step = self.stream_interval
        for start in range(0, n, step):
            i = min(start + step, n)  # tokens so far, this event's included
            k = i - start
            ev = {
                "output_ids": [tok] * k,
                "meta_info": {
                    "id": req.get("rid") or "fake",
                    "prompt_tokens": n_prompt,
                    "completion_tokens": i,
                    "finish_reason": {"type": "length", "length": n} if i == n else None,
                    "weight_version": "default",
                    "output_token_logprobs": [[0.0, tok, None]] * k,
                },
            }
            events.append(b"data: " + dumps(ev) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        if not self.interval_s:
            for data in events:
                self._chunk(data)
            self.t.write(b"0\r\n\r\n")
            return
        # One token per step, each step scheduled by the one before: timers set up front
        # (token i at i steps) fired out of order under uvloop now and then, and a stream
        # then skipped its first token.
        self._paced(events, 0)

    def chat(self, body):
        req = loads(body)
        want = req.get("max_tokens") or req.get("max_completion_tokens") or self.tokens
        n = max(1, min(int(want), self.tokens))
        stream = bool(req.get("stream"))
        usage = stream and bool((req.get("stream_options") or {}).get("include_usage"))
        key = (n, stream, usage)
        events = self.chats.get(key)
        if events is None:
            events = self.chats[key] = _chat(self.model, n, stream, usage, self.stream_interval)
        if not stream:
            return self.reply(b"200 OK", events[0])
        self.t.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        if not self.interval_s:
            for data in events:
                self._chunk(data)
            self.t.write(b"0\r\n\r\n")
            return
        self._paced(events, 0)

    def _paced(self, events, i):
        if self.t.is_closing():
            return
        self._chunk(events[i])
        if i == len(events) - 2:  # the last token: [DONE] and the end go with it
            self._chunk(events[-1])
            self.t.write(b"0\r\n\r\n")
            return
        # An event of k tokens is k decode steps after the one before.
        asyncio.get_running_loop().call_later(
            self.interval_s * self.stream_interval, self._paced, events, i + 1
        )

    def _chunk(self, data):
        self.t.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def _write_ready(path: str, host: str, port: int) -> None:
    Path(path + ".tmp").write_text(json.dumps({"pid": os.getpid(), "host": host, "port": port}))
    os.replace(path + ".tmp", path)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-interval-ms", type=float, default=0.0)
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed event, as SGLang's --stream-interval (paced N steps apart)",
    )
    ap.add_argument("--model-id", default="tiny-parrot", help="the model /v1/models lists")
    ap.add_argument("--ready-file", default="")
    args = ap.parse_args()
    _Engine.tokens = args.tokens
    _Engine.model = args.model_id
    _Engine.info = _info(args.model_id)
    _Engine.interval_s = args.token_interval_ms / 1000
    _Engine.stream_interval = max(1, args.stream_interval)
    server = await asyncio.get_running_loop().create_server(_Engine, args.host, args.port)
    port = server.sockets[0].getsockname()[1]
    if args.ready_file:
        _write_ready(args.ready_file, args.host, port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
