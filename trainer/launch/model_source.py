"""Where the job's checkpoint comes from: ``model.path`` is an HF folder, ``smollm2`` (the real
SmolLM2-135M-Instruct, converted once into the cache) or ``tiny:VARIANT`` (a tiny random model of
`models.checkpoints.tiny.TINY_CONFIGS` made on the spot, seeded by trainer.seed, in the cache).

`check_checkpoint` holds the folder against its family's mapping (tensor headers only, no data)
so a checkpoint that lacks a tensor fails before any process of the job starts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from models.checkpoints.smollm2 import cache_dir


def resolve_model(spec: str, seed: int = 0) -> Path:
    """The HF folder `spec` names (made or converted first when needed).

    Raises:
      ValueError: an empty spec, no such folder, or a folder without config.json; KeyError:
        an unknown tiny variant; FileNotFoundError: SmolLM2's package is not installed.
    """
    if not spec:
        raise ValueError("model.path is empty: give an HF folder, 'smollm2' or 'tiny:VARIANT'")
    if spec == "smollm2":
        from models.checkpoints.smollm2 import ensure_smollm2

        return ensure_smollm2()
    if spec.startswith("tiny:"):
        from models.checkpoints.tiny import make_tiny_checkpoint

        variant = spec.removeprefix("tiny:")
        out = cache_dir() / "tiny" / f"{variant}-seed{seed}"
        if not (out / "tokenizer.json").exists():  # made in a side folder, then renamed
            tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
            make_tiny_checkpoint(tmp, variant, seed=seed)
            shutil.rmtree(out, ignore_errors=True)
            try:
                tmp.rename(out)
            except OSError:  # another run made it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
        return out
    path = Path(spec)
    if not path.exists():
        raise ValueError(
            f"model.path {spec!r}: no such folder; give an HF folder with config.json, "
            "'smollm2' or 'tiny:VARIANT'"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path: expected an HF folder with config.json, got {spec!r}")
    return path


def check_checkpoint(path: Path, family: str) -> None:
    """Hold the HF folder `path` against `family`'s mapping: every tensor the mapping needs is
    there with the rule's shape, none is left unmapped, and the JAX model's param shapes agree
    (`mappings.check.check_folder`, safetensors headers only; the engine's own check runs
    where it starts).

    Raises:
      ValueError: the findings, one per line, naming the folder and the family.
    """
    from mappings.check import check_folder
    from mappings.registry import get_family

    report = check_folder(get_family(family), path, with_engine=False)
    if not report.ok:
        lines = "\n  ".join(report.lines())
        raise ValueError(
            f"model.path {str(path)!r} does not match the {family} mapping; nothing was "
            f"started:\n  {lines}"
        )
