"""TLS with the gateway's own certificate (`python -m gateway make-cert`): plaintext, untrusted
and wrongly named clients fail; the make-cert command writes a key only its owner reads."""

import stat
import subprocess
import sys

import pytest

from gateway.client import GatewayClient
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.server import GatewayServer

pytest.importorskip("cryptography.x509", reason="the cryptography package is absent")
from gateway.certs import make_cert  # noqa: E402

TOKENS = {"trainer": "t" * 20, "engine": "e" * 20}


def test_tls_round_trip_and_refusals(tmp_path):
    cert, key = make_cert(tmp_path / "server", ["localhost", "127.0.0.1"])
    other, _ = make_cert(tmp_path / "other", ["localhost", "127.0.0.1"])
    srv = GatewayServer(GatewayConfig(), TOKENS, cert_file=cert, key_file=key).start()
    try:
        assert srv.tls
        with GatewayClient(srv.address, TOKENS["trainer"], cert.read_bytes()) as ok:
            assert ok.publish_version(1) == []
            assert ok.status().current_version == 1
        with GatewayClient(srv.address, TOKENS["trainer"], margin_s=2.0) as plain:
            with pytest.raises(GatewayError) as err:
                plain.status()
            assert err.value.code == "UNAVAILABLE"
        with GatewayClient(srv.address, TOKENS["trainer"], other.read_bytes(), margin_s=2.0) as c:
            with pytest.raises(GatewayError) as err:
                c.status()
            assert err.value.code == "UNAVAILABLE"
    finally:
        srv.stop(0)


def test_a_client_dialling_a_name_the_certificate_lacks_is_refused(tmp_path):
    """The certificate names node0 and 127.0.0.1 only: dialling localhost fails the TLS
    handshake (UNAVAILABLE), dialling 127.0.0.1 works."""
    cert, key = make_cert(tmp_path, ["node0", "127.0.0.1"])
    srv = GatewayServer(GatewayConfig(), TOKENS, cert_file=cert, key_file=key).start()
    try:
        with GatewayClient(f"127.0.0.1:{srv.port}", TOKENS["trainer"], cert.read_bytes()) as ok:
            assert ok.status().current_version == 0
        with GatewayClient(
            f"localhost:{srv.port}", TOKENS["trainer"], cert.read_bytes(), margin_s=2.0
        ) as wrong:
            with pytest.raises(GatewayError) as err:
                wrong.status()
            assert err.value.code == "UNAVAILABLE"
    finally:
        srv.stop(0)


def test_make_cert_command_writes_an_owner_only_key(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "make-cert", str(tmp_path), "--name", "node0",
         "--name", "198.18.0.10"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"wrote {tmp_path}/gateway.pem and {tmp_path}/gateway.key for node0, 198.18.0.10"
    )
    assert stat.S_IMODE((tmp_path / "gateway.key").stat().st_mode) == 0o600
    bad = subprocess.run(
        [sys.executable, "-m", "gateway", "make-cert", str(tmp_path), "--name", "a b"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert (bad.returncode, bad.stderr.strip()) == (
        2, "make-cert: 'a b' is neither an address nor a host name"
    )  # fmt: skip


def test_tls_needs_both_cert_and_key(tmp_path):
    cert, _ = make_cert(tmp_path, ["localhost"])
    with pytest.raises(ValueError, match="both a certificate and a key"):
        GatewayServer(GatewayConfig(), TOKENS, cert_file=cert)
