"""Client for SGLang's native HTTP API (`/generate` with input ids).

Streaming: SGLang sends cumulative `output_ids` (and logprobs) by default and only the
new ones with `--incremental-streaming-output`; `completion_tokens - len(output_ids)` is
the offset of the chunk's first id either way, so both modes read the same tokens. Only the
incremental mode costs the proxy linear time: a cumulative event holds everything so far,
so an answer of n tokens moves and parses O(n^2) numbers. areal starts SGLang with the
flag (areal_cli.engines); cumulative mode is still read correctly for an engine started by
hand.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from areal_proxy.engine.base import (
    EngineError,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    engine_constraint,
)
from areal_proxy.engine.refusals import body_message, is_refusal_status, refusal
from areal_proxy.engine.transport import (
    CONNECT_TIMEOUT_S,
    LOST,
    NOT_CONNECTED,
    PROBE_TIMEOUT_S,
    EngineTransport,
    sse_batches,
    stream_unfinished,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _sampling_params(req: GenerationRequest) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        # The proxy decodes text itself, from the ids.
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if req.stop_token_ids:
        params["stop_token_ids"] = req.stop_token_ids
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    if (constraint := engine_constraint(req.constraint)) is not None:
        kind, value = constraint
        params[kind] = value
    params.update(req.extra)
    return params


def _payload(req: GenerationRequest, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "sampling_params": _sampling_params(req),
        "return_logprob": True,
        "stream": stream,
    }
    if req.top_logprobs:
        body["top_logprobs_num"] = req.top_logprobs
    if req.rid:
        body["rid"] = req.rid
    if req.input_ids_json is not None:
        # The ids encoded once per session turn's new part (prompt/incremental.py), spliced
        # in: `body` always has keys, so its encoding starts `{"`.
        rest = orjson.dumps(body)
        return b"".join((b'{"input_ids":', req.input_ids_json, b",", memoryview(rest)[1:]))
    body["input_ids"] = req.input_ids
    return orjson.dumps(body)


def _finish(meta: dict[str, Any]) -> tuple[str | None, int | None]:
    fr = meta.get("finish_reason")
    if not fr:
        return None, None
    kind = _FINISH.get(fr.get("type", ""), "stop")
    matched = fr.get("matched")
    return kind, matched if isinstance(matched, int) else None


def _http_error(raw: bytes, status: int) -> EngineError:
    """A /generate that answered an error status: SGLang's 400 is its refusal of the request
    (too long, a grammar it cannot compile: the client's error); anything else is the engine's."""
    if is_refusal_status(status):
        return refusal(body_message(raw), status=400)
    return EngineError(f"engine /generate -> {status}: {raw[:300]!r}", status=502)


def _refused_in(meta: dict[str, Any]) -> EngineError | None:
    """SGLang refuses a streamed request with a first event whose finish reason is an abort
    with a 4xx `status_code` (and a junk token); an abort the proxy asked for has none."""
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") != "abort":
        return None
    code = fr.get("status_code")
    if isinstance(code, int) and 400 <= code < 500:
        return refusal(str(fr.get("message") or "the engine refused the request"))
    return None


def _tops(meta: dict[str, Any], start: int) -> list[list[tuple[int, float]]]:
    tops = meta.get("output_top_logprobs") or []
    return [[(int(t[1]), float(t[0])) for t in step or []] for step in tops[start:]]


def _event_error(out: dict[str, Any]) -> EngineError:
    err = out["error"]
    msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    code = err.get("code", 400) if isinstance(err, dict) else 400
    # An engine that rejects the request before any token (e.g. context too long) is the
    # client's error.
    status = code if isinstance(code, int) else 400
    if is_refusal_status(status):
        return refusal(msg)
    return EngineError(f"engine error during generation: {msg}", status=502)


class SGLangClient:
    """One client per engine replica, over one pooled connection (transport.py)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = None,
        api_key: str = "",
        connect_timeout: float = CONNECT_TIMEOUT_S,
        probe_timeout: float = PROBE_TIMEOUT_S,
    ) -> None:
        self._t = EngineTransport(
            base_url,
            timeout=timeout,
            api_key=api_key,
            connect_timeout=connect_timeout,
            probe_timeout=probe_timeout,
        )
        self.base_url = self._t.base_url
        self._generate_url = self._t.url("/generate")

    async def close(self) -> None:
        await self._t.close()

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """A control call: its JSON answer, or its text; any error status is the engine's."""
        answer = await self._t.control(path, body)
        raw = answer.body
        if answer.status >= 400:
            raise EngineError(f"engine {path} -> {answer.status}: {raw[:300]!r}", status=502)
        return orjson.loads(raw) if raw and "json" in answer.content_type else raw.decode()

    async def health(self) -> bool | None:
        return await self._t.health()

    async def context_limit(self) -> int:
        """One more than the longest prompt this engine takes: SGLang's `max_req_input_len`
        (/get_server_info), the smaller of the model's context and the KV cache
        (--max-total-tokens) less a margin of 6; a prompt that long is refused, an output is cut
        to fit the rest. 0: the engine does not say. EngineError: it did not answer."""
        info = await self._t.probe_json("/get_server_info")
        n = info.get("max_req_input_len") if isinstance(info, dict) else None
        return n if isinstance(n, int) and n > 0 else 0

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        out = await self._post_generate(req)
        meta = out.get("meta_info", {})
        if (refused := _refused_in(meta)) is not None:
            raise refused
        lps = meta.get("output_token_logprobs") or []
        finish, _ = _finish(meta)
        return GenerationResult(
            token_ids=list(out.get("output_ids", [])),
            logprobs=[float(t[0]) for t in lps],
            top_logprobs=_tops(meta, 0),
            finish_reason=finish or "stop",
            prompt_tokens=int(meta.get("prompt_tokens", len(req.input_ids))),
            weight_version=str(meta.get("weight_version", "")),
        )

    async def _post_generate(self, req: GenerationRequest) -> dict[str, Any]:
        try:
            async with await self._t.post(self._generate_url, _payload(req, False)) as r:
                raw = await r.read()
                if r.status >= 400:
                    raise _http_error(raw, r.status)
                return orjson.loads(raw)
        except NOT_CONNECTED as e:
            raise self._t.unreachable(e) from e
        except LOST as e:
            # The engine went away mid-request (killed, crashed): 503, not retried here, but
            # the request may continue on another replica (migration).
            raise EngineError(
                f"engine connection lost at {self.base_url}: {e!r}", status=503, lost=True
            ) from e
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(f"engine /generate failed: {e!r}", status=502) from e

    async def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        emitted = 0
        try:
            async with await self._t.post(self._generate_url, _payload(req, True)) as r:
                if r.status >= 400:
                    raise _http_error(await r.read(), r.status)
                # Every event one read completes makes one chunk: under load (or with a
                # slow client) several wait in the buffer, and each wake-up downstream costs
                # the same whatever the chunk carries.
                async for events in sse_batches(r.content):
                    chunk: GenerationChunk | None = None
                    for data in events:
                        if data == b"[DONE]":
                            break
                        out = orjson.loads(data)
                        if "error" in out:
                            raise _event_error(out)
                        meta = out.get("meta_info", {})
                        if (refused := _refused_in(meta)) is not None:
                            raise refused
                        ids = out.get("output_ids") or []
                        offset = int(meta.get("completion_tokens", len(ids))) - len(ids)
                        if offset > emitted:
                            # Tokens between what was read and this event never arrived (a
                            # slice from a negative start would silently take the wrong ones).
                            raise EngineError(
                                f"engine stream skipped tokens {emitted}..{offset - 1}",
                                status=502,
                            )
                        new_ids = ids[emitted - offset :]
                        lps = meta.get("output_token_logprobs") or []
                        lp_offset = int(meta.get("completion_tokens", len(lps))) - len(lps)
                        new_lps = [float(t[0]) for t in lps[emitted - lp_offset :]]
                        finish, matched = _finish(meta)
                        if not new_ids and finish is None:
                            continue
                        start = emitted - lp_offset
                        emitted += len(new_ids)
                        version = str(meta.get("weight_version", ""))
                        tops = _tops(meta, start) if req.top_logprobs else []
                        if chunk is not None and chunk.weight_version == version:
                            # The same attempt's next tokens: one chunk (a version change
                            # starts a new one, so each token keeps its own).
                            chunk.token_ids.extend(new_ids)
                            chunk.logprobs.extend(new_lps)
                            chunk.top_logprobs.extend(tops)
                            chunk.finish_reason, chunk.matched_stop = finish, matched
                        else:
                            if chunk is not None:
                                yield chunk
                            chunk = GenerationChunk(
                                token_ids=list(new_ids),
                                logprobs=new_lps,
                                top_logprobs=tops,
                                finish_reason=finish,
                                matched_stop=matched,
                                prompt_tokens=int(meta.get("prompt_tokens", len(req.input_ids))),
                                weight_version=version,
                            )
                        if finish is not None:
                            break
                    if chunk is not None:
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
                    if b"[DONE]" in events:
                        break
        except NOT_CONNECTED as e:
            raise self._t.unreachable(e) from e
        except LOST as e:
            raise EngineError(
                f"engine connection lost at {self.base_url} after {emitted} tokens: {e!r}",
                status=503,
                lost=True,
            ) from e
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineError(
                f"engine stream failed after {emitted} tokens: {e!r}", status=502
            ) from e
        raise stream_unfinished(emitted)

    async def abort(self, rid: str | None = None) -> None:
        body = {"rid": rid} if rid else {"abort_all": True}
        await self._post("/abort_request", body)

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation; with mode "abort" in-flight requests end with finish "abort"."""
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def update_weights_from_disk(self, path: str, version: str | None = None) -> None:
        body: dict[str, Any] = {"model_path": path}
        if version is not None:
            body["weight_version"] = version
        out = await self._post("/update_weights_from_disk", body)
        if isinstance(out, dict) and not out.get("success", False):
            raise EngineError(f"engine refused the weight update: {out.get('message')}", status=502)

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    async def model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await self._t.get_json("/get_model_info")
        return info
