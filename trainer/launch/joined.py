"""Joining a gateway started elsewhere (``launch.gateway=HOST:PORT``): connect with the token
file, and refuse a gateway whose engines hold newer weights than this run starts from.

A gateway outlives the runs that join it: after a finished run it stays at that run's last
weight version, and its engines serve those weights. A new run (or one resumed from an older
checkpoint) would evaluate "step 0" on them and then fail on the first group, started at a
version newer than the trainer's. `check_start_version` says so before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from gateway.client import GatewayClient
from gateway.errors import PERMISSION_DENIED, UNAUTHENTICATED, GatewayError
from trainer.user_error import UserError


def start_version(run_dir: Path, resume: bool) -> int:
    """The weight version this run starts at: that of the newest checkpoint in
    ``run_dir/checkpoints`` (its ``progress/metadata`` JSON) when `resume`, else 0.

    Raises:
      UserError: the newest checkpoint's progress file is missing or unreadable.
    """
    folder = run_dir / "checkpoints"
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    steps = sorted(int(name) for name in names if name.isdigit())
    if not resume or not steps:
        return 0
    meta = folder / str(steps[-1]) / "progress" / "metadata"
    try:
        return int(json.loads(meta.read_text())["weight_version"])
    except (OSError, ValueError, KeyError) as err:
        raise UserError(
            f"checkpoint step {steps[-1]} ({meta.parent.parent}) is damaged: its progress file "
            f"cannot be read ({type(err).__name__}: {err})"
        ) from err


def connect(
    address: str, token_file: Path, wait_s: float, ca_file: str | Path | None = None
) -> GatewayClient:
    """A trainer-role client of the gateway at `address`, once it answers (over TLS, trusting
    `ca_file`, when given: launch.gateway_ca_file).

    Raises:
      UserError: the token file is missing or malformed (a token under 16 characters), or no
        gateway answered at `address` within `wait_s` seconds (launch.gateway_wait_s).
    """
    try:
        client = GatewayClient.from_token_file(
            address, token_file, "trainer", ca_file, margin_s=10.0
        )
    except (OSError, ValueError) as err:
        raise UserError(f"launch.token_file: {err}") from err
    try:
        client.wait_ready(wait_s)
    except GatewayError as err:
        client.close()
        raise UserError(
            f"launch.gateway={address}: no gateway answered within {wait_s:g} s "
            f"(launch.gateway_wait_s); start `python -m gateway serve` there or fix the address"
        ) from err
    return client


def refused_token(err: GatewayError, address: str, token_file: Path) -> UserError | None:
    """The plain error of a gateway call refused for the trainer's token, else None."""
    if err.code not in (UNAUTHENTICATED, PERMISSION_DENIED):
        return None
    return UserError(
        f"the gateway at {address} refused the trainer token of {token_file} "
        f"(launch.token_file): {err.message}"
    )


def check_start_version(client: GatewayClient, address: str, run_dir: Path, resume: bool) -> None:
    """Refuse a joined gateway whose current weight version is newer than this run's start.

    Raises:
      UserError: the gateway is at version V > the run's start version S (the sentence names
        both and what to do); as `start_version`.
    """
    start = start_version(run_dir, resume)
    current = int(client.status().current_version)
    if current > start:
        raise UserError(
            f"the gateway at {address} is at weight version {current} (its engines serve the "
            f"weights of an earlier run) but this run starts at version {start}; nothing was "
            f"started: restart the gateway and its engines, or resume that run's run_dir"
        )
