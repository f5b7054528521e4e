"""`python -m trainer COMMAND`: `parity` (the model-parity demo on SmolLM2 or any HF folder)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Parses the command line before any heavy import; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    parity = sub.add_parser("parity", help="JAX vs transformers on one checkpoint")
    parity.add_argument("--model", type=Path, default=None, help="HF folder (default: SmolLM2)")
    parity.add_argument("--prompt", default="What is 17 + 25? Answer with a number.")
    parity.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    if args.command == "parity":
        from trainer.checkpoints.smollm2 import ensure_smollm2
        from trainer.parity import run_parity

        result = run_parity(args.model or ensure_smollm2(), args.prompt, args.new_tokens)
        print(json.dumps(result, indent=2))
        return 0 if result["same_tokens"] else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
