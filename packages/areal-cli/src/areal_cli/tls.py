"""A service's TLS material: its own CA and the one certificate all its components share.

    pki = make_service_pki()                  # PEM strings: ca_cert, cert, key
    env = write_pki(service_dir / "tls", pki) # 0600 files in a 0700 folder -> AREAL_TLS_* env

The services read `env` (areal_runtime.tls): with it their internal gRPC is mutual TLS. Every
component of the service holds the same certificate, whose SAN is DNS:areal-internal, and
checks its peers against that name rather than the address it dialed (a component's address
is known only once it runs; areal_runtime.tls says more). The CA is made per service, so the
certificate of another service is refused, and its private key is not kept: nothing can
issue another certificate this service trusts. A new certificate (the ~1 year one has
expired) is a new CA and certificate for the whole service, at its next start.

`cryptography` is imported inside the functions: `areal --help` and the local commands never
load it (importing this module costs nothing).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from areal_cli.private_files import make_dir

# The environment areal_runtime.tls reads (the CLI does not depend on the runtime package).
CA_ENV = "AREAL_TLS_CA"
CERT_ENV = "AREAL_TLS_CERT"
KEY_ENV = "AREAL_TLS_KEY"
# The DNS SAN of every service certificate; areal_runtime.tls.SERVER_NAME.
SERVER_NAME = "areal-internal"

CA_DAYS = 3650
CERT_DAYS = 365
# Certificates are valid from a little before now: a node whose clock is slightly behind
# the launching machine's still accepts them.
_BACKDATE_S = 300

FILE_NAMES = {CA_ENV: "ca.pem", CERT_ENV: "cert.pem", KEY_ENV: "key.pem"}
_PKI_KEYS = {CA_ENV: "ca_cert", CERT_ENV: "cert", KEY_ENV: "key"}


def make_service_pki() -> dict[str, str]:
    """A new CA (EC P-256, ~10 years) and the service certificate it issued (EC P-256,
    ~1 year, SAN DNS:areal-internal, server and client auth), as PEM strings: `ca_cert`,
    `cert` and its private key `key`. The CA's own key is dropped."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=_BACKDATE_S)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "areal service CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return {
        "ca_cert": ca_cert.public_bytes(pem).decode(),
        "cert": cert.public_bytes(pem).decode(),
        "key": key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
    }


def _write_private(path: Path, text: str) -> None:
    """Write `path` whole with mode 0600 (a reader never sees part of it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "w", encoding="ascii") as f:
            fd = -1
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_pki(directory: Path, pki: dict[str, str]) -> dict[str, str]:
    """Write `pki` (as `make_service_pki` returns it) as ca.pem, cert.pem and key.pem, each
    0600, in `directory` (made 0700). Returns the environment that gives a service those
    files: AREAL_TLS_CA, AREAL_TLS_CERT, AREAL_TLS_KEY, absolute paths (never the PEMs)."""
    directory = make_dir(Path(directory)).resolve()
    os.chmod(directory, 0o700)
    env: dict[str, str] = {}
    for var, name in FILE_NAMES.items():
        path = directory / name
        _write_private(path, pki[_PKI_KEYS[var]])
        env[var] = str(path)
    return env
