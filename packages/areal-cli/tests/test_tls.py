"""A service's CA and shared certificate (areal_cli.tls): what is made, and how it is kept."""

from __future__ import annotations

import datetime
import os
import stat
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from areal_cli import tls


@pytest.fixture(scope="module")
def pki() -> dict[str, str]:
    return tls.make_service_pki()


def test_certificate_is_issued_by_the_ca_for_areal_internal(pki):
    ca = x509.load_pem_x509_certificate(pki["ca_cert"].encode())
    cert = x509.load_pem_x509_certificate(pki["cert"].encode())
    cert.verify_directly_issued_by(ca)  # raises if not
    ca.verify_directly_issued_by(ca)  # self-signed
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [tls.SERVER_NAME]
    assert san.get_values_for_type(x509.IPAddress) == []

    ca_bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert ca_bc.critical and ca_bc.value.ca
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ca_ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ca_ku.key_cert_sign and not ca_ku.digital_signature
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}

    now = datetime.datetime.now(datetime.UTC)
    for c, days in ((ca, tls.CA_DAYS), (cert, tls.CERT_DAYS)):
        assert c.not_valid_before_utc <= now
        left = c.not_valid_after_utc - now
        assert datetime.timedelta(days=days - 1) < left <= datetime.timedelta(days=days)
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)


def test_key_is_the_certificates_ec_p256_key(pki):
    key = serialization.load_pem_private_key(pki["key"].encode(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(key.curve, ec.SECP256R1)
    cert = x509.load_pem_x509_certificate(pki["cert"].encode())
    assert cert.public_key() == key.public_key()


def test_each_service_gets_its_own_ca():
    a, b = tls.make_service_pki(), tls.make_service_pki()
    assert a["ca_cert"] != b["ca_cert"] and a["key"] != b["key"]
    cert_b = x509.load_pem_x509_certificate(b["cert"].encode())
    with pytest.raises(InvalidSignature):
        cert_b.verify_directly_issued_by(x509.load_pem_x509_certificate(a["ca_cert"].encode()))


def test_files_are_0600_in_a_0700_folder_and_env_has_paths_only(tmp_path, pki):
    old = os.umask(0o022)
    try:
        env = tls.write_pki(tmp_path / "svc" / "tls", pki)
    finally:
        os.umask(old)
    assert set(env) == {"AREAL_TLS_CA", "AREAL_TLS_CERT", "AREAL_TLS_KEY"}
    d = tmp_path / "svc" / "tls"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "svc").stat().st_mode) == 0o700
    assert sorted(p.name for p in d.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]
    for var, value in env.items():
        path = d / tls.FILE_NAMES[var]
        assert value == str(path.resolve())
        assert os.path.isabs(value)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert "-----BEGIN" not in value and "\n" not in value
    assert (d / "ca.pem").read_text() == pki["ca_cert"]
    assert (d / "cert.pem").read_text() == pki["cert"]
    assert (d / "key.pem").read_text() == pki["key"]
    key_body = pki["key"].splitlines()[1]
    assert all(key_body not in v for v in env.values())


def test_rewriting_replaces_files_and_tightens_an_existing_folder(tmp_path, pki):
    d = tmp_path / "tls"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    (d / "key.pem").write_text("old")
    (d / "key.pem").chmod(0o644)
    tls.write_pki(d, pki)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "key.pem").stat().st_mode) == 0o600
    assert (d / "key.pem").read_text() == pki["key"]
    assert sorted(p.name for p in d.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]


def test_cli_import_does_not_load_cryptography():
    code = "import sys, areal_cli.main, areal_cli.tls; print('cryptography' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
