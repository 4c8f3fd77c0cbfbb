"""Long generations on real engines for the migration and drain suites: one in-flight
request (`Call`), sent with a session key, streamed or whole, with what came back and when;
and the recorded output of an exported row."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "tiny"
MAX_TOKENS = 200
SCHEMA = {
    "type": "object",
    # Longer than 200 tokens can write: the grammar is still open when the engine dies.
    "properties": {"text": {"type": "string", "minLength": 1500}},
    "required": ["text"],
    "additionalProperties": False,
}


@dataclass
class Call:
    """One in-flight request: what came back and when."""

    session: dict[str, str]
    kind: str  # stream | whole | constrained | n2
    status: int = 0
    chunks: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def token_chunks(self) -> list[tuple[float, dict[str, Any]]]:
        return [(t, c) for t, c in self.chunks if lp_entries(c) or content_of(c)]

    def content(self) -> str:
        if self.kind in ("whole", "n2"):
            return self.body["choices"][0]["message"]["content"] or ""
        return "".join(content_of(c) for _, c in self.chunks)

    def logprobs(self) -> list[float]:
        if self.kind in ("whole", "n2"):
            return [e["logprob"] for e in self.body["choices"][0]["logprobs"]["content"]]
        return [e["logprob"] for _, c in self.chunks for e in lp_entries(c)]

    def finish(self) -> str | None:
        if self.kind in ("whole", "n2"):
            return self.body["choices"][0]["finish_reason"]
        done = [ch["finish_reason"] for _, c in self.chunks for ch in c.get("choices", [])]
        return next((f for f in done if f), None)

    def usage(self) -> dict[str, Any]:
        if self.kind in ("whole", "n2"):
            return self.body["usage"]
        return next(c["usage"] for _, c in self.chunks if c.get("usage"))


def content_of(chunk: dict[str, Any]) -> str:
    return "".join((ch.get("delta") or {}).get("content") or "" for ch in chunk.get("choices", []))


def lp_entries(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for ch in chunk.get("choices", []):
        out += (ch.get("logprobs") or {}).get("content") or []
    return out


def messages_of(session_id: str, first_answer: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"first turn of {session_id}"},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "now a long one"},
    ]


async def run_call(client: httpx.AsyncClient, call: Call, first_answer: str) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages_of(call.session["session_id"], first_answer),
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
    }
    if call.kind != "constrained":
        # The parrot repeats its last token; the penalties make it move on every few tokens,
        # so a token dropped or repeated at the seam changes the text and the logprobs.
        body |= {
            "ignore_eos": True,
            "logprobs": True,
            "frequency_penalty": 2.0,
            "presence_penalty": 2.0,
            "temperature": 2.0,
        }
    if call.kind == "constrained":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "t", "schema": SCHEMA},
        }
    if call.kind == "n2":
        body["n"] = 2
    headers = {"Authorization": f"Bearer {call.session['session_api_key']}"}
    if call.kind in ("whole", "n2"):
        call.started.set()
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        call.status, call.body = r.status_code, r.json()
        call.error = call.body.get("error")
        return
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        call.status = r.status_code
        if r.status_code != 200:
            call.error = json.loads(await r.aread()).get("error")
            call.started.set()
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                call.error = chunk["error"]
                continue
            call.chunks.append((time.monotonic(), chunk))
            if len(call.token_chunks()) >= 3:
                call.started.set()
    call.started.set()


def output(row: dict[str, Any]) -> tuple[int, list[int], list[float]]:
    """(index of the first output position, output ids, their logprobs)."""
    pos = [i for i, m in enumerate(row["loss_mask"]) if m]
    assert pos == list(range(pos[0], pos[0] + len(pos))), "output positions are not one run"
    return pos[0], [row["input_ids"][i] for i in pos], [row["logprobs"][i] for i in pos]
