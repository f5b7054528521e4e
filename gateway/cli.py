"""`python -m gateway serve|status|make-tokens|make-cert`: run a gateway, print its status, make
tokens, make its TLS certificate (`gateway.certs`).

Imports only grpc and the protos (no JAX, torch or vLLM): the server starts in well under a
second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path

from gateway.config import GatewayConfig, RunSettings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a gateway server until shut down")
    serve.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one")
    serve.add_argument("--token-file", type=Path, required=True, help="role=token lines")
    serve.add_argument("--cert", type=Path, help="PEM certificate chain (TLS)")
    serve.add_argument("--key", type=Path, help="PEM private key (TLS)")
    serve.add_argument("--port-file", type=Path, help="write the bound port here")
    serve.add_argument("--lease-seconds", type=float, default=GatewayConfig.lease_seconds)
    serve.add_argument("--heartbeat-timeout", type=float, default=GatewayConfig.heartbeat_timeout_s)
    serve.add_argument("--heartbeat-interval", type=float, default=0.0, help="0: timeout / 3")
    serve.add_argument("--rollout-capacity", type=int, default=GatewayConfig.rollout_capacity)
    serve.add_argument("--max-pending", type=int, default=GatewayConfig.max_pending_prompts)
    serve.add_argument("--max-wait", type=float, default=GatewayConfig.max_wait_s)
    serve.add_argument("--max-message-mb", type=int, default=64)
    serve.add_argument(
        "--max-workers",
        type=int,
        default=GatewayConfig.max_concurrent_rpcs,
        help="threads serving calls, and the most calls in progress at once",
    )
    serve.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other GatewayConfig field, e.g. --set max_name_chars=128 (repeatable)",
    )
    serve.add_argument("--family", default="", help="the run's model family, if known now")
    serve.add_argument("--mapping", default="")
    serve.add_argument("--dtype", default="")
    serve.add_argument("--transport", default="")
    serve.add_argument("--rendezvous", default="")
    serve.add_argument("--backends", default="", help="comma-separated allowed backends")
    serve.add_argument(
        "--adapter", default="", help="adapter-only run: the LoRA engines must serve (their key)"
    )
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument(
        "--events-file", type=Path, help="append the event log (gateway.events) here, JSONL"
    )

    status = sub.add_parser("status", help="print engines, versions, queue depths and rates")
    status.add_argument("--address", required=True, help="HOST:PORT")
    status.add_argument("--token-file", type=Path, required=True)
    status.add_argument("--role", default="trainer", choices=("trainer", "engine"))
    status.add_argument("--ca", type=Path, help="PEM certificate to trust (TLS)")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
    status.add_argument("--json", action="store_true", help="print JSON instead of text")

    tokens = sub.add_parser(
        "make-tokens", help="write a fresh token file (mode 0600; its folder is made if missing)"
    )
    tokens.add_argument("path", type=Path)

    cert = sub.add_parser(
        "make-cert", help="write DIR/gateway.pem and DIR/gateway.key for the given host names"
    )
    cert.add_argument("folder", type=Path)
    cert.add_argument(
        "--name", action="append", required=True,
        help="a host name or address clients dial the gateway by (repeatable)",
    )  # fmt: skip
    cert.add_argument("--days", type=float, default=30.0, help="days the certificate is valid")
    return parser


def _overrides(items: list[str]) -> dict[str, object]:
    """`FIELD=VALUE` strings as GatewayConfig keyword arguments (or `RunSettings` ones, which
    `_serve` puts in its `settings`), each VALUE of its field's type.

    Raises:
        SystemExit: an item is not FIELD=VALUE, names no field, or is of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(GatewayConfig) if f.name != "settings"}
    fields |= {f.name: f for f in dataclasses.fields(RunSettings)}
    out: dict[str, object] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields or fields[name].type == "tuple[str, ...]":
            raise SystemExit(f"--set: expected FIELD=VALUE for a GatewayConfig field, got {item!r}")
        kind = {"int": int, "float": float, "str": str}[str(fields[name].type)]
        try:
            out[name] = kind(value)
        except ValueError:
            raise SystemExit(f"--set {name}: expected {kind.__name__}, got {value!r}") from None
    return out


def serve_config(argv: list[str]) -> GatewayConfig:
    """The `GatewayConfig` a `serve ...` command line (as `gateway_argv` of the launcher
    writes it, without `python -m gateway`) runs with.

    Raises:
        SystemExit: a bad flag (argparse); ValueError: a value the config refuses.
    """
    return _config(_parser().parse_args(argv))


def _config(args: argparse.Namespace) -> GatewayConfig:
    """The `GatewayConfig` of parsed `serve` flags (`--set key=value` overrides last)."""
    flags = dict(
        max_concurrent_rpcs=args.max_workers,
        lease_seconds=args.lease_seconds,
        heartbeat_timeout_s=args.heartbeat_timeout,
        heartbeat_interval_s=args.heartbeat_interval,
        max_pending_prompts=args.max_pending,
        rollout_capacity=args.rollout_capacity,
        max_wait_s=args.max_wait,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        settings=RunSettings(
            model_family=args.family,
            mapping=args.mapping,
            dtype=args.dtype,
            transport=args.transport,
            rendezvous_address=args.rendezvous,
            backends=tuple(b for b in args.backends.split(",") if b),
            adapter=args.adapter,
        ),
    )
    overrides = _overrides(args.set)
    run = {k: overrides.pop(k) for k in list(overrides) if k in RunSettings.__dataclass_fields__}
    flags["settings"] = dataclasses.replace(flags["settings"], **run)  # type: ignore[arg-type]
    return GatewayConfig(**{**flags, **overrides})  # type: ignore[arg-type]


def _serve(args: argparse.Namespace) -> int:
    from gateway.auth import load_tokens
    from gateway.lifeline import hold_to_launcher
    from gateway.server import GatewayServer

    hold_to_launcher()  # a launcher that started this gateway takes it along when it dies
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    config = _config(args)
    server = GatewayServer(
        config,
        load_tokens(args.token_file),
        host=args.host,
        port=args.port,
        cert_file=args.cert,
        key_file=args.key,
        events_file=args.events_file,
    ).start()
    if args.port_file:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(server.port))
        tmp.replace(args.port_file)
    print(f"gateway listening on {server.address} tls={server.tls}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server._stop_soon("signal"))
    server.wait()
    return 0


def _status(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from gateway.client import GatewayClient
    from gateway.status import format_status

    with GatewayClient.from_token_file(
        args.address, args.token_file, args.role, ca_file=args.ca, margin_s=args.timeout
    ) as client:
        reply = client.status()
    if args.json:
        print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True)))
    else:
        print(format_status(reply))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the subcommand; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        from gateway.errors import GatewayError

        try:
            return _status(args)
        except GatewayError as e:
            print(f"status failed: {e}", file=sys.stderr)
            return 1
    if args.command == "make-cert":
        from gateway.certs import make_cert

        try:
            cert_path, key_path = make_cert(args.folder, args.name, args.days)
        except ValueError as e:
            print(str(e), file=sys.stderr)
            return 2
        print(f"wrote {cert_path} and {key_path} for {', '.join(args.name)}")
        return 0
    from gateway.auth import write_tokens

    args.path.parent.mkdir(parents=True, exist_ok=True)  # e.g. runs/tokens.txt (git-ignored)
    write_tokens(args.path)
    print(f"wrote trainer and engine tokens to {args.path}")
    return 0
