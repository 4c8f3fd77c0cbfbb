"""A scripted SGLang-compatible engine for the harness tests: it answers by rule, with real
tool calls for the calling harness's own shell tool, and logs every request.

    python tests/harness/scripted_engine.py --model-path models/tiny-parrot --log calls.jsonl \
        --ready-file ready.json [--port 0]

It speaks SGLang's native API as areal's proxy uses it (`POST /generate` with `input_ids`,
streamed with incremental output or whole; areal_proxy/engine/sglang.py) and answers what the
proxy and router probe (`/health`, `/get_server_info` with `max_req_input_len`,
`/get_model_info`, ...). It tokenizes and detokenizes with the model folder's own
`tokenizer.json`, the file the proxy reads, so what it decodes is the prompt the proxy built
and what it samples is the exact ids of its answer's text.

The rule, on the decoded prompt:
- Which harness calls is told by the tools the prompt declares (the model folder's template
  renders them between `<tools>` and `</tools>`, one JSON object each): Claude Code's `Bash`,
  Codex's `exec_command`, OpenCode's `bash` (among a dozen tools), mini-swe-agent's `bash`
  (its only tool). A prompt with none of them is a side call (a title, a summary):
  a short plain answer.
- How far the task is, by how many tool results the prompt holds: each command the rule
  writes prints `areal-tool-42` by arithmetic (`$((40+2))`), so the marker appears in the
  prompt only where a tool's output came back, never in what the model wrote.
  0 results: write `areal-proof.txt` (Codex, read-only by default: print only);
  1: list the folder; 2 or more: the final answer (mini-swe-agent: its submit command).
- The answer is text + the end-of-turn id; a tool call is hermes' `<tool_call>{json}
  </tool_call>` after a line of text and a newline, arguments as `json.dumps` writes them.
  The parrot's template renders a call with no newline before it, and OpenCode echoes
  arguments as compact JSON: like a real model's, the answer is not what re-rendering the
  conversation gives, so only a recording that keeps the sampled ids gets it right.
  Logprobs are a fixed function of the position, so a test can compare them exactly.

With `--relay URL` it scripts nothing: it passes every request on to a real engine at URL
(SGLang serving the real model) and logs what that engine received and sampled, the same way.

Every request is one JSON line in `--log`: the input ids, the ids and logprobs it answered
with, whether it streamed, the harness and step it saw, whether it was a side call, and
whether it failed on purpose (`POST /script {"fail_once_at_step": k}` makes the first
request of step k of each harness answer 500 once: the harness's retry must be recorded once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from tokenizers import Tokenizer

MARKER = "areal-tool-42"
# The shell writes the marker by arithmetic: the command text never contains it.
_ECHO = "echo areal-tool-$((40+2))"
PROOF_FILE = "areal-proof.txt"
FINAL_TEXT = "FINAL ANSWER: the proof file holds areal-tool-42."
SIDE_TEXT = "Harness smoke test"
# A harness still calling tools after this many results gets plain text (ends any loop).
_GIVE_UP_STEP = 6
# Token budget the engine claims: Claude Code's first prompt is ~50k ids with a 512-id vocab.
CONTEXT = 131072


@dataclass(frozen=True)
class Answer:
    harness: str
    step: int
    side: bool
    text: str


def _declared_tools(prompt: str) -> list[dict[str, Any]]:
    """The tool objects between the first `<tools>` and `</tools>` of the prompt."""
    start = prompt.find("<tools>")
    end = prompt.find("</tools>", start)
    if start < 0 or end < 0:
        return []
    body = prompt[start + len("<tools>") : end]
    dec = json.JSONDecoder()
    tools, at = [], 0
    while True:
        while at < len(body) and body[at].isspace():
            at += 1
        if at >= len(body):
            return tools
        try:
            obj, at = dec.raw_decode(body, at)
        except json.JSONDecodeError:
            return tools
        if isinstance(obj, dict):
            tools.append(obj.get("function", obj))


def _harness(tools: list[dict[str, Any]]) -> str:
    by_name = {t.get("name"): t for t in tools if isinstance(t, dict)}
    if "Bash" in by_name:
        return "claude"
    if "exec_command" in by_name:
        return "codex"
    if "bash" in by_name:
        # mini-swe-agent declares its one tool; OpenCode declares a dozen beside `bash`.
        return "mini" if len(by_name) == 1 else "opencode"
    return ""


def _call(name: str, arguments: dict[str, Any], why: str) -> str:
    # What a hermes model writes: a line of text, then the call, arguments as json.dumps.
    return f"{why}\n<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _command(harness: str, step: int) -> str:
    if step == 0:
        # Codex runs commands read-only by default: it only prints.
        return _ECHO if harness == "codex" else f"{_ECHO} | tee {PROOF_FILE}"
    return f"ls; {_ECHO}"


def answer(prompt: str) -> Answer:
    """The scripted answer to a decoded prompt."""
    harness = _harness(_declared_tools(prompt))
    step = prompt.count(MARKER)
    if not harness:
        return Answer("", step, True, SIDE_TEXT)
    if step >= 2:
        if harness == "mini" and step < _GIVE_UP_STEP:
            # mini-swe-agent ends when a command's first output line is its submit word; the
            # rest of the output is the submission.
            cmd = f"printf 'COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\\n{FINAL_TEXT}\\n'"
            return Answer(harness, step, False, _call("bash", {"command": cmd}, "Submitting."))
        return Answer(harness, step, False, FINAL_TEXT)
    cmd = _command(harness, step)
    why = "Writing the proof file." if step == 0 else "Listing the folder."
    if harness == "claude":
        text = _call("Bash", {"command": cmd, "description": why}, why)
    elif harness == "codex":
        text = _call("exec_command", {"cmd": cmd}, why)
    elif harness == "opencode":
        text = _call("bash", {"command": cmd, "description": why}, why)
    else:
        text = _call("bash", {"command": cmd}, why)
    return Answer(harness, step, False, text)


def logprob(prompt_len: int, i: int) -> float:
    """A fixed, exactly representable logprob for output position i."""
    return -float(1 + (prompt_len * 31 + i * 17) % 97) / 64.0


@dataclass
class Engine:
    tok: Tokenizer
    eos: int
    model: str
    log_path: Path
    fail_once_at_step: int = -1
    failed: set[str] = field(default_factory=set)
    count: int = 0

    def log(self, entry: dict[str, Any]) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = await request.json()
        ids = req.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return web.json_response({"error": {"message": "input_ids required"}}, status=400)
        params = req.get("sampling_params") or {}
        # Decoding 50k ids and encoding the answer take milliseconds; off the loop anyway.
        prompt = await asyncio.to_thread(self.tok.decode, ids, skip_special_tokens=False)
        ans = answer(prompt)
        out = [*self.tok.encode(ans.text, add_special_tokens=False).ids, self.eos]
        budget = int(params.get("max_new_tokens") or len(out))
        finish: dict[str, Any] = {"type": "stop", "matched": self.eos}
        if len(out) > budget:
            out = out[:budget]
            finish = {"type": "length", "length": budget}
        lps = [logprob(len(ids), i) for i in range(len(out))]
        self.count += 1
        entry = {
            "n": self.count,
            "t": time.time(),
            "rid": req.get("rid", ""),
            "stream": bool(req.get("stream")),
            "harness": ans.harness,
            "step": ans.step,
            "side": ans.side,
            "max_new_tokens": params.get("max_new_tokens"),
            "input_ids": ids,
            "output_ids": out,
            "logprobs": lps,
            # Tool calls written in the answer (what a row's parse status must count).
            "tool_calls": ans.text.count("<tool_call>"),
            "failed": False,
        }
        if ans.step == self.fail_once_at_step and not ans.side and ans.harness not in self.failed:
            self.failed.add(ans.harness)
            self.log({**entry, "output_ids": [], "logprobs": [], "failed": True})
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        self.log(entry)
        rid = req.get("rid") or f"scripted-{self.count}"

        def meta(done: int, chunk_lps: list[float], chunk_ids: list[int], last: bool) -> dict:
            return {
                "id": rid,
                "prompt_tokens": len(ids),
                "completion_tokens": done,
                "finish_reason": finish if last else None,
                "weight_version": "default",
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(chunk_lps, chunk_ids, strict=True)
                ],
            }

        if not req.get("stream"):
            return web.json_response(
                {"text": "", "output_ids": out, "meta_info": meta(len(out), lps, out, True)}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # Incremental output (what areal starts SGLang with), a few ids an event.
        for at in range(0, len(out), 4):
            chunk = out[at : at + 4]
            last = at + 4 >= len(out)
            ev = {
                "text": "",
                "output_ids": chunk,
                "meta_info": meta(at + len(chunk), lps[at : at + 4], chunk, last),
            }
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def script(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.fail_once_at_step = int(body.get("fail_once_at_step", -1))
        self.failed.clear()
        return web.json_response({"ok": True})


@dataclass
class Relay:
    """Passes requests on to a real engine; logs each /generate as the scripted engine does."""

    upstream: str
    log_path: Path
    tok: Tokenizer
    count: int = 0
    http: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))
        return self.http

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        url = self.upstream + request.path_qs
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        if request.path != "/generate":
            async with self.session().request(request.method, url, data=body, headers=headers) as r:
                return web.Response(
                    body=await r.read(), status=r.status, content_type=r.content_type
                )
        req = json.loads(body)
        self.count += 1
        prompt = await asyncio.to_thread(
            self.tok.decode, req.get("input_ids") or [], skip_special_tokens=False
        )
        # Who calls, as the scripted engine tells it (the real model decides what to answer).
        harness = _harness(_declared_tools(prompt))
        entry: dict[str, Any] = {
            "n": self.count,
            "t": time.time(),
            "rid": req.get("rid", ""),
            "stream": bool(req.get("stream")),
            "harness": harness,
            "step": prompt.count(MARKER),
            "side": not harness,
            "max_new_tokens": (req.get("sampling_params") or {}).get("max_new_tokens"),
            "input_ids": req.get("input_ids"),
            "output_ids": [],
            "logprobs": [],
            "failed": True,
        }
        try:
            async with self.session().post(url, data=body, headers=headers) as r:
                if not req.get("stream") or r.status != 200:
                    raw = await r.read()
                    if r.status == 200:
                        out = json.loads(raw)
                        self._take(entry, out)
                        entry["failed"] = False
                    entry["status"] = r.status
                    return web.Response(body=raw, status=r.status, content_type=r.content_type)
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                buf = b""
                async for data in r.content.iter_any():
                    await resp.write(data)
                    buf += data
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                            ev = json.loads(line[5:])
                            self._take(entry, ev)
                            if (ev.get("meta_info") or {}).get("finish_reason"):
                                entry["failed"] = False
                await resp.write_eof()
                return resp
        finally:
            with self.log_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    @staticmethod
    def _take(entry: dict[str, Any], out: dict[str, Any]) -> None:
        """Add an answer's (or an incremental stream event's) ids and logprobs."""
        meta = out.get("meta_info") or {}
        ids = out.get("output_ids") or []
        done = int(meta.get("completion_tokens", len(ids)))
        # Incremental events carry only the new ids; a whole answer carries all of them.
        start = done - len(ids)
        entry["output_ids"][start:] = ids
        lps = [float(t[0]) for t in meta.get("output_token_logprobs") or []]
        entry["logprobs"][done - len(lps) :] = lps
        entry["finish"] = meta.get("finish_reason")


def relay_app(relay: Relay) -> web.Application:
    a = web.Application(client_max_size=256 * 1024 * 1024)
    a.router.add_route("*", "/{tail:.*}", relay.forward)
    return a


def app(engine: Engine) -> web.Application:
    ok = {"status": "ok"}
    server_info = {
        "model_path": engine.model,
        "tokenizer_path": engine.model,
        "served_model_name": engine.model,
        "context_length": CONTEXT,
        "max_req_input_len": CONTEXT - 8,
        "max_total_num_tokens": 4 * CONTEXT,
        "version": "scripted",
        "internal_states": [{"last_gen_throughput": 0.0}],
    }
    model_info = {
        "model_path": engine.model,
        "tokenizer_path": engine.model,
        "is_generation": True,
        "weight_version": "default",
        "model_type": "scripted",
    }

    def fixed(body: dict) -> Any:
        async def handler(_: web.Request) -> web.Response:
            return web.json_response(body)

        return handler

    a = web.Application(client_max_size=256 * 1024 * 1024)
    a.router.add_post("/generate", engine.generate)
    a.router.add_post("/script", engine.script)
    for path in ("/health", "/health_generate"):
        a.router.add_get(path, fixed({}))
    for path in ("/get_server_info", "/server_info"):
        a.router.add_get(path, fixed(server_info))
    for path in ("/get_model_info", "/model_info"):
        a.router.add_get(path, fixed(model_info))
    a.router.add_get("/v1/models", fixed({"object": "list", "data": [{"id": engine.model}]}))
    for path in ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache"):
        a.router.add_post(path, fixed(ok))
    return a


def write_ready(path: str, host: str, port: int) -> None:
    Path(path + ".tmp").write_text(json.dumps({"pid": os.getpid(), "host": host, "port": port}))
    os.replace(path + ".tmp", path)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="folder with tokenizer.json")
    ap.add_argument("--model-id", default="scripted")
    ap.add_argument("--log", required=True, help="JSON lines, one per request")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ready-file", default="")
    ap.add_argument("--relay", default="", help="a real engine's URL: pass on and log only")
    args = ap.parse_args()
    folder = Path(args.model_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    eos_token = cfg["eos_token"]
    eos = tok.token_to_id(eos_token if isinstance(eos_token, str) else eos_token["content"])
    engine = Engine(tok, eos, args.model_id, Path(args.log))
    served = (
        relay_app(Relay(args.relay.rstrip("/"), Path(args.log), tok)) if args.relay else app(engine)
    )
    runner = web.AppRunner(served, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if args.ready_file:
        write_ready(args.ready_file, args.host, port)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
