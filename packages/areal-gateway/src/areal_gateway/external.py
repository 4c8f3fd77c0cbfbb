"""External models: OpenAI-compatible URLs outside the service (admin key only).

One pooled `httpx.AsyncClient` serves every forwarded request (never a client per request).
The body is forwarded with `model` replaced by the upstream model name; streams are passed
through byte for byte as they arrive. Registration validates the URL first.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import InvalidRequest, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)

VALIDATE_TIMEOUT = 10.0


def normalize_base_url(base_url: str) -> str:
    """`base_url` if it is a plain http(s) URL (no credentials, no query), without trailing /."""
    try:
        parts = urlsplit(base_url.strip())
    except ValueError as exc:
        raise InvalidRequest(f"base_url is not a URL: {exc}", param="base_url") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidRequest(
            "base_url must be an http:// or https:// URL", code="invalid_url", param="base_url"
        )
    if not parts.hostname:
        raise InvalidRequest("base_url has no host", code="invalid_url", param="base_url")
    if parts.username or parts.password:
        raise InvalidRequest(
            "base_url must not carry credentials; pass the key as api_key",
            code="invalid_url",
            param="base_url",
        )
    if parts.query or parts.fragment:
        raise InvalidRequest(
            "base_url must not have a query or fragment", code="invalid_url", param="base_url"
        )
    return base_url.strip().rstrip("/")


def _auth_headers(api_key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class ExternalForwarder:
    def __init__(self) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
            follow_redirects=False,
            trust_env=False,
        )

    async def validate(self, base_url: str, api_key: str) -> str:
        """Normalized `base_url` once `GET {base_url}/models` answered 200 in time; else 400."""
        url = normalize_base_url(base_url)
        try:
            resp = await self._client.get(
                url + "/models", headers=_auth_headers(api_key), timeout=VALIDATE_TIMEOUT
            )
        except httpx.TimeoutException:
            raise InvalidRequest(
                f"base_url check failed: GET {url}/models did not answer within {VALIDATE_TIMEOUT:g} s",
                code="invalid_url",
                param="base_url",
            ) from None
        except httpx.HTTPError as exc:
            raise InvalidRequest(
                f"base_url check failed: GET {url}/models: {type(exc).__name__}: {exc}",
                code="invalid_url",
                param="base_url",
            ) from None
        if resp.status_code != 200:
            raise InvalidRequest(
                f"base_url check failed: GET {url}/models answered {resp.status_code} (expected 200)",
                code="invalid_url",
                param="base_url",
            )
        return url

    def _request(
        self, model: router_pb2.ModelInfo, path: str, doc: dict[str, Any], timeout_s: float
    ) -> httpx.Request:
        body = dict(doc)
        body["model"] = model.upstream_model or model.name
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            **_auth_headers(model.api_key),
        }
        return self._client.build_request(
            "POST",
            model.base_url.rstrip("/") + path,
            content=orjson.dumps(body),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        )

    async def send(
        self, model: router_pb2.ModelInfo, path: str, doc: dict[str, Any], timeout_s: float
    ) -> httpx.Response:
        """Open the upstream response (headers read, body not yet)."""
        request = self._request(model, path, doc, timeout_s)
        try:
            return await self._client.send(request, stream=True)
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"external model {model.name} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(
                f"external model {model.name} failed: {type(exc).__name__}"
            ) from None

    @staticmethod
    async def read(resp: httpx.Response, name: str) -> bytes:
        try:
            return await resp.aread()
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"external model {name} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"external model {name} failed: {type(exc).__name__}") from None
        finally:
            await resp.aclose()

    @staticmethod
    async def iter_bytes(resp: httpx.Response, name: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_bytes():
                if chunk:
                    yield chunk
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"external model {name} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"external model {name} failed: {type(exc).__name__}") from None
        finally:
            await resp.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()
