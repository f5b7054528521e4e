"""What an engine checks of its own model before anything else: the checkpoint folder holds
every tensor its family's mapping needs, with the rule's shapes, and no tensor the mapping
leaves out (`mappings.check.check_folder`, safetensors headers only: no data is read, and
neither JAX nor vLLM is imported, so no device is touched).

vLLM itself loads a folder missing a tensor with a warning and serves the random weights it
leaves; the launcher refuses such a folder before it starts an engine
(`trainer.launch.model_source.check_checkpoint`), and an engine started by hand refuses it
here, before it contacts the gateway.
"""

from __future__ import annotations

from pathlib import Path


class ModelRefused(ValueError):
    """The engine's model folder does not match its family's mapping (the message names the
    folder, the family and every finding, one per line)."""


def check_model(model: str | Path, family: str) -> None:
    """Hold the HF folder `model` against `family`'s mapping.

    Raises:
        ModelRefused: a missing, unmapped, doubly mapped or mis-shaped tensor (each on a line
            of its own), or a folder the checker cannot read (no config.json, no safetensors).
    """
    from mappings.check import check_folder
    from mappings.registry import get_family

    try:
        report = check_folder(get_family(family), model, with_engine=False, with_jax=False)
    except (OSError, ValueError) as err:
        raise ModelRefused(f"model {str(model)!r} cannot be checked: {err}") from err
    if not report.ok:
        lines = "\n  ".join(report.lines())
        raise ModelRefused(
            f"model {str(model)!r} does not match the {family} mapping; the engine did not "
            f"start or register:\n  {lines}"
        )
