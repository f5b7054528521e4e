"""Regenerate the checked-in `*_pb2.py`, `*_pb2_grpc.py` and `*_pb2.pyi` from the `.proto` files.

Usage: `python -m protos.generate` (or `python protos/generate.py`) from the repository root.
The proto files import each other as `protos/<name>.proto`, so the generated modules import
each other as `from protos import <name>_pb2`. `tests/unit/protos/test_generated_in_sync.py`
regenerates into a temporary folder and fails when the checked-in files differ.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("rollout.proto", "gateway.proto")


def generated_names() -> list[str]:
    """The file names (relative to `protos/`) that generation writes, sorted."""
    stems = [name.removesuffix(".proto") for name in PROTO_FILES]
    suffixes = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
    return sorted(stem + suffix for stem in stems for suffix in suffixes)


def generate(out_root: Path) -> list[Path]:
    """Run grpcio-tools' protoc; write the generated modules under `out_root/protos/`.

    Args:
        out_root: a folder standing for the repository root; `out_root/protos/` is created.

    Returns:
        The paths written, sorted.

    Raises:
        RuntimeError: protoc failed (its exit status is in the message).
    """
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR.parent}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *(f"protos/{name}" for name in PROTO_FILES),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc exited with status {status}; expected 0 (args: {args})")
    return [out_root / "protos" / name for name in generated_names()]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: regenerate in place (default) or into `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=PROTO_DIR.parent, help="root to write protos/ under"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
