"""Tokens and roles: who may call what.

A token file holds one `role=token` line per role (`#` starts a comment):

    trainer=3q2...
    engine=Zx9...

The trainer token may configure the run, submit prompts, fetch rollouts, publish versions
and shut the gateway down; the engine token may register engines, lease, return rollouts
and acknowledge versions; both may report metrics and read the status. Every call carries
`authorization: Bearer <token>` metadata, compared in constant time (`hmac.compare_digest`)
against every role's token.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from gateway.errors import PERMISSION_DENIED, UNAUTHENTICATED, GatewayError

TRAINER = "trainer"
ENGINE = "engine"
ROLES = (TRAINER, ENGINE)
METADATA_KEY = "authorization"
_MIN_TOKEN_CHARS = 16


def load_tokens(path: str | os.PathLike) -> dict[str, str]:
    """Read a token file into {role: token}.

    Raises:
        ValueError: a line is not `role=token`, a role is unknown or repeated, a token is
            shorter than 16 characters, two roles share a token, or a role is missing.
        FileNotFoundError: no such file.
    """
    tokens: dict[str, str] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        role, sep, token = (part.strip() for part in line.partition("="))
        where = f"{path}:{number}"
        if not sep or role not in ROLES:
            raise ValueError(f"{where}: expected 'trainer=TOKEN' or 'engine=TOKEN', got {raw!r}")
        if role in tokens:
            raise ValueError(f"{where}: expected each role once, got {role!r} again")
        if len(token) < _MIN_TOKEN_CHARS:
            raise ValueError(
                f"{where}: expected a token of >= {_MIN_TOKEN_CHARS} characters, got {len(token)}"
            )
        tokens[role] = token
    missing = [r for r in ROLES if r not in tokens]
    if missing:
        raise ValueError(f"{path}: expected a token for each of {list(ROLES)}, missing {missing}")
    if tokens[TRAINER] == tokens[ENGINE]:
        raise ValueError(f"{path}: expected different trainer and engine tokens, got one token")
    return tokens


def write_tokens(path: str | os.PathLike) -> dict[str, str]:
    """Write a fresh token file (mode 0600) with random trainer and engine tokens."""
    tokens = {role: secrets.token_urlsafe(32) for role in ROLES}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# gateway tokens: one role=token line per role\n")
        f.writelines(f"{role}={token}\n" for role, token in tokens.items())
    return tokens


class Authenticator:
    """Maps call metadata to a role and checks it against the roles a method allows."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self._tokens = [(role, token.encode()) for role, token in tokens.items()]

    def role_of(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The role whose token the metadata carries.

        Raises:
            GatewayError: UNAUTHENTICATED when the token is missing or matches no role.
        """
        value = next((v for k, v in metadata if k == METADATA_KEY), None)
        if value is None:
            raise GatewayError(
                UNAUTHENTICATED, f"expected '{METADATA_KEY}: Bearer <token>' metadata, got none"
            )
        raw = value.encode() if isinstance(value, str) else value
        presented = raw.removeprefix(b"Bearer ")
        role = ""
        for name, token in self._tokens:  # compare against all, whatever matches
            if hmac.compare_digest(presented, token):
                role = name
        if not role:
            raise GatewayError(UNAUTHENTICATED, "expected a valid token, got one matching no role")
        return role

    def check(
        self, metadata: Iterable[tuple[str, str | bytes]], method: str, allowed: tuple[str, ...]
    ) -> str:
        """Return the caller's role, or raise UNAUTHENTICATED / PERMISSION_DENIED."""
        role = self.role_of(metadata)
        if role not in allowed:
            raise GatewayError(
                PERMISSION_DENIED,
                f"{method}: expected a token of role {' or '.join(allowed)}, got role {role}",
            )
        return role
