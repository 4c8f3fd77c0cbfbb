"""Mutual TLS from the environment (areal_runtime.tls), over a real gRPC server on loopback.

The certificates are made with the `openssl` command line: areal-runtime does not depend on
`cryptography` (the CLI, which makes the real ones, does).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from areal_runtime import tls

pytestmark = pytest.mark.timeout(30)

METHOD = "/areal.test.Echo/Ping"


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_pki(directory: Path, san: str = tls.SERVER_NAME) -> dict[str, str]:
    """A CA and one certificate it issued (SAN DNS:`san`, server and client auth), as the
    AREAL_TLS_* environment naming their files."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (
        directory / n for n in ("ca.key", "ca.pem", "key.pem", "csr", "cert.pem")
    )
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1",
             "-subj", "/CN=areal test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    _openssl("req", "-new", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN={san}")
    ext = directory / "ext.cnf"
    ext.write_text(
        f"subjectAltName=DNS:{san}\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
             "-days", "1", "-out", cert, "-extfile", ext)  # fmt: skip
    os.chmod(key, 0o600)
    return {tls.CA_ENV: str(ca), tls.CERT_ENV: str(cert), tls.KEY_ENV: str(key)}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("service"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Another service's: its own CA, a certificate with the same name."""
    return make_pki(tmp_path_factory.mktemp("other"))


@pytest.fixture(autouse=True)
def fresh_config(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in tls.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    tls.config.cache_clear()
    yield
    tls.config.cache_clear()


@pytest.fixture
def tls_env(monkeypatch: pytest.MonkeyPatch, pki: dict[str, str]) -> dict[str, str]:
    for var, path in pki.items():
        monkeypatch.setenv(var, path)
    tls.config.cache_clear()
    return pki


async def _ping(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"pong:" + request


@pytest.fixture
async def server_address() -> AsyncIterator[str]:
    """An echo server bound with `tls.bind` under whatever environment the test set."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "areal.test.Echo", {"Ping": grpc.unary_unary_rpc_method_handler(_ping)}
            )
        ]
    )
    port = tls.bind(server, "127.0.0.1:0")
    assert port
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def _call(ch: grpc.aio.Channel) -> bytes:
    async with ch:
        return await ch.unary_unary(METHOD)(b"hi", timeout=5)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _override() -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", tls.SERVER_NAME)]


async def _refused(ch: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await _call(ch)
    return exc.value.code()


async def test_no_environment_is_plaintext(server_address: str):
    assert not tls.enabled()
    assert await _call(tls.channel(server_address)) == b"pong:hi"
    assert await _call(grpc.aio.insecure_channel(server_address)) == b"pong:hi"


async def test_tls_client_is_served_at_an_ip_address(tls_env, server_address: str):
    # The certificate names areal-internal only, not 127.0.0.1: the name override is what
    # lets a client check it.
    assert tls.enabled()
    opts = [("grpc.max_receive_message_length", 1024)]
    assert await _call(tls.channel(server_address, options=opts)) == b"pong:hi"


async def test_plaintext_client_is_refused(tls_env, server_address: str):
    code = await _refused(grpc.aio.insecure_channel(server_address))
    assert code == grpc.StatusCode.UNAVAILABLE


async def test_client_without_certificate_is_refused(tls_env, server_address: str):
    creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_env[tls.CA_ENV]))
    ch = grpc.aio.secure_channel(server_address, creds, options=_override())
    assert await _refused(ch) == grpc.StatusCode.UNAVAILABLE


async def test_client_certificate_from_another_ca_is_refused(
    tls_env, other_pki, server_address: str
):
    # It trusts this service's CA, but its own certificate is another service's.
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls_env[tls.CA_ENV]),
        private_key=_read(other_pki[tls.KEY_ENV]),
        certificate_chain=_read(other_pki[tls.CERT_ENV]),
    )
    ch = grpc.aio.secure_channel(server_address, creds, options=_override())
    assert await _refused(ch) == grpc.StatusCode.UNAVAILABLE


async def test_client_of_another_service_is_refused(tls_env, other_pki, server_address: str):
    cfg = tls.load(other_pki)
    assert cfg is not None
    ch = grpc.aio.secure_channel(server_address, cfg.channel_credentials(), options=_override())
    assert await _refused(ch) == grpc.StatusCode.UNAVAILABLE


async def test_server_with_a_certificate_from_another_ca_is_not_trusted(
    monkeypatch, tls_env, other_pki, server_address: str
):
    # The server holds this service's certificate; a client configured for the other
    # service (same SAN, other CA) refuses it.
    for var, path in other_pki.items():
        monkeypatch.setenv(var, path)
    tls.config.cache_clear()
    assert await _refused(tls.channel(server_address)) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("given", [(tls.CA_ENV,), (tls.CERT_ENV, tls.KEY_ENV), (tls.KEY_ENV,)])
async def test_partial_environment_is_a_clear_error(monkeypatch, pki, given):
    for var in given:
        monkeypatch.setenv(var, pki[var])
    with pytest.raises(tls.TLSConfigError) as exc:
        tls.config()
    msg = str(exc.value)
    for var in tls.ENV_VARS:
        assert var in msg
    assert isinstance(exc.value, ValueError)  # what each service's startup reports
    with pytest.raises(tls.TLSConfigError):
        tls.bind(grpc.aio.server(), "127.0.0.1:0")


def test_unreadable_file_is_a_clear_error(tmp_path, pki):
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(tls.TLSConfigError, match=rf"{tls.CERT_ENV}={missing}: cannot read"):
        tls.load({**pki, tls.CERT_ENV: missing})
    with pytest.raises(tls.TLSConfigError, match=rf"{tls.KEY_ENV}={missing}: cannot read"):
        tls.load({**pki, tls.KEY_ENV: missing})


def test_file_that_is_not_pem_is_a_clear_error(tmp_path, pki):
    # The key where the CA certificate belongs.
    with pytest.raises(tls.TLSConfigError, match=rf"{tls.CA_ENV}=.*not a PEM certificate"):
        tls.load({**pki, tls.CA_ENV: pki[tls.KEY_ENV]})
    junk = tmp_path / "junk.pem"
    junk.write_text("hello")
    junk.chmod(0o600)
    with pytest.raises(tls.TLSConfigError, match=rf"{tls.KEY_ENV}=.*not a PEM private key"):
        tls.load({**pki, tls.KEY_ENV: str(junk)})


def test_key_others_can_read_is_refused(tmp_path, pki):
    key = tmp_path / "key.pem"
    key.write_bytes(_read(pki[tls.KEY_ENV]))
    key.chmod(0o644)
    with pytest.raises(tls.TLSConfigError, match=r"mode 0644.*0600"):
        tls.load({**pki, tls.KEY_ENV: str(key)})
    key.chmod(0o600)
    assert tls.load({**pki, tls.KEY_ENV: str(key)}) is not None


def test_empty_variables_count_as_unset():
    assert tls.load({var: "" for var in tls.ENV_VARS}) is None
