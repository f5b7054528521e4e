"""`python -m mappings check --family F HF_DIR`: exits 1 and lists every problem found."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parses the command line and runs the checker; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m mappings")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="hold a family's mapping against an HF folder")
    check.add_argument("--family", required=True, help="family name, e.g. llama, qwen2")
    check.add_argument("folder", help="HF checkpoint folder (config.json + safetensors)")
    check.add_argument("--no-engine", action="store_true", help="skip the vLLM names check")
    args = parser.parse_args(argv)

    from mappings.check import check_folder
    from mappings.registry import get_family

    report = check_folder(get_family(args.family), args.folder, with_engine=not args.no_engine)
    for line in report.lines():
        print(line)
    print(f"{args.family}: {'OK' if report.ok else f'{len(report.lines())} problem(s)'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
