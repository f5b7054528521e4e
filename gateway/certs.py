"""The gateway's own TLS certificate: `python -m gateway make-cert DIR --name HOST ...`.

One self-signed certificate (a CA of itself, ECDSA P-256, SHA-256) whose subject alternative
names are every host name and address clients reach the gateway by; the server serves it
(``serve --cert DIR/gateway.pem --key DIR/gateway.key``) and every client trusts it (the
engines' ``--ca-file``, the trainer's ``launch.gateway_ca_file``, ``status --ca``). gRPC checks
the name the client dialled against those names, so a certificate made for ``node0`` and
``198.18.0.10`` is refused by a client dialling any other address.

Imports `cryptography` only inside `make_cert` (the gateway starts in well under a second).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

CERT_NAME = "gateway.pem"
KEY_NAME = "gateway.key"


def make_cert(folder: str | Path, names: Sequence[str], days: float = 30.0) -> tuple[Path, Path]:
    """Write ``folder/gateway.pem`` (certificate) and ``folder/gateway.key`` (private key, mode
    0600) for `names` (host names and IPv4/IPv6 addresses), valid from a minute ago for
    `days` days; returns (certificate path, key path).

    Raises:
        ValueError: no names, or a name that is neither an address nor a DNS name.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not names:
        raise ValueError("make-cert: expected at least one host name or address")
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError as err:
            if not name or any(c in name for c in " /:@") or len(name) > 253:
                msg = f"make-cert: {name!r} is neither an address nor a host name"
                raise ValueError(msg) from err
            alt.append(x509.DNSName(name))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / CERT_NAME, out / KEY_NAME
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path
