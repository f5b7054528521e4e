"""TLS: a self-signed certificate made in the test; plaintext and untrusted clients fail."""

import datetime
import ipaddress

import pytest

from gateway.client import GatewayClient
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.server import GatewayServer

x509 = pytest.importorskip("cryptography.x509", reason="the cryptography package is absent")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _self_signed(tmp_path, name):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_tls_round_trip_and_refusals(tmp_path):
    cert, key = _self_signed(tmp_path, "server")
    other, _ = _self_signed(tmp_path, "other")
    tokens = {"trainer": "t" * 20, "engine": "e" * 20}
    srv = GatewayServer(GatewayConfig(), tokens, cert_file=cert, key_file=key).start()
    try:
        assert srv.tls
        with GatewayClient(srv.address, tokens["trainer"], cert.read_bytes()) as ok:
            assert ok.publish_version(1) == []
            assert ok.status().current_version == 1
        with GatewayClient(srv.address, tokens["trainer"], margin_s=2.0) as plain:
            with pytest.raises(GatewayError) as err:
                plain.status()
            assert err.value.code == "UNAVAILABLE"
        with GatewayClient(srv.address, tokens["trainer"], other.read_bytes(), margin_s=2.0) as c:
            with pytest.raises(GatewayError) as err:
                c.status()
            assert err.value.code == "UNAVAILABLE"
    finally:
        srv.stop(0)


def test_tls_needs_both_cert_and_key(tmp_path):
    cert, _ = _self_signed(tmp_path, "server")
    with pytest.raises(ValueError, match="both a certificate and a key"):
        GatewayServer(GatewayConfig(), {"trainer": "t" * 20, "engine": "e" * 20}, cert_file=cert)
