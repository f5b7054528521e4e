"""Holds a family's mapping against a checkpoint (and, where vLLM is installed, against the
engine's fused parameter names).

Reports every checkpoint tensor no rule maps, every rule whose tensor the checkpoint lacks,
every name mapped twice, every shape that differs from the rule's layout, and every JAX
param shape that differs from the model's. Reads tensor headers only, never the data.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mappings.spec import Family, MappingError, Rule, condition_holds, expand


@dataclasses.dataclass
class CheckReport:
    """The checker's findings; `ok` when every list is empty."""

    family: str
    unmapped: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    doubly_mapped: list[str] = dataclasses.field(default_factory=list)
    shape_mismatch: list[str] = dataclasses.field(default_factory=list)
    engine_mismatch: list[str] = dataclasses.field(default_factory=list)
    family_mismatch: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not (
            self.family_mismatch
            or self.unmapped
            or self.missing
            or self.doubly_mapped
            or self.shape_mismatch
            or self.engine_mismatch
        )

    def lines(self) -> list[str]:
        """Human-readable findings, one per line."""
        out = []
        fields = ("family_mismatch", "unmapped", "missing", "doubly_mapped", "shape_mismatch",
                  "engine_mismatch")  # fmt: skip
        for field in fields:
            for item in getattr(self, field):
                out.append(f"{field}: {item}")
        return out


def check_mapping(
    family: Family,
    cfg: Any,
    checkpoint_shapes: Mapping[str, tuple[int, ...]],
    jax_shapes: Mapping[str, tuple[int, ...]] | None = None,
    engine_packed: Mapping[str, tuple[str, ...]] | None = None,
) -> CheckReport:
    """Checks `family` for config `cfg` against tensor shapes.

    Args:
        checkpoint_shapes: HF tensor name -> shape (from the safetensors headers).
        jax_shapes: JAX param path -> shape of the model built for `cfg`, if known.
        engine_packed: the engine's packed modules (vLLM's `packed_modules_mapping`), if
            known; every fused target of a rule must be one of them with a matching part.
    """
    report = CheckReport(family=family.name)
    try:
        rules = expand(family, cfg)
    except MappingError as err:
        report.doubly_mapped.append(str(err))
        return report
    mapped = {r.hf for r in rules}
    for name in sorted(set(checkpoint_shapes) - mapped):
        why = ""
        if name == family.tied_head and family.is_tied(cfg):
            why = " (the mapping declares tied embeddings but the checkpoint has a separate head)"
        elif off := _rule_turned_off(family, cfg, name):
            why = (
                f" (rule {off.jax} maps it only when {off.when!r} holds, and this config.json "
                f"turns {off.when!r} off)"
            )
        report.unmapped.append(f"{name}{why}")
    for r in rules:
        if r.hf not in checkpoint_shapes:
            why = ""
            if r.hf == family.tied_head:
                why = " (the mapping declares an untied head but the checkpoint ties it)"
            report.missing.append(f"{r.hf} (for {r.jax}){why}")
        elif tuple(checkpoint_shapes[r.hf]) != r.hf_shape:
            report.shape_mismatch.append(
                f"{r.hf}: checkpoint {tuple(checkpoint_shapes[r.hf])}, "
                f"rule {r.rule.hf_axes!r} -> {r.hf_shape}"
            )
    if jax_shapes is not None:
        for r in rules:
            if r.jax not in jax_shapes:
                report.missing.append(f"{r.jax} (JAX param for {r.hf}) is not in the model")
            elif tuple(jax_shapes[r.jax]) != r.jax_shape:
                report.shape_mismatch.append(
                    f"{r.jax}: model {tuple(jax_shapes[r.jax])}, "
                    f"rule {r.rule.jax_axes!r} -> {r.jax_shape} (from {r.hf})"
                )
        for path in sorted(set(jax_shapes) - {r.jax for r in rules}):
            report.unmapped.append(f"{path} (JAX param no rule produces)")
    if engine_packed is not None:
        for r in rules:
            if r.fused is None:
                continue
            packed = r.fused[0].rsplit(".", 2)[-2]
            part = r.hf.rsplit(".", 2)[-2]
            if part not in engine_packed.get(packed, ()):
                report.engine_mismatch.append(
                    f"{r.hf}: fused into {packed!r}, but the engine packs "
                    f"{packed!r} from {list(engine_packed.get(packed, ()))}"
                )
    return report


def _rule_turned_off(family: Family, cfg: Any, name: str) -> Rule | None:
    """The rule of `family` whose HF name pattern matches `name` but whose `when` does not
    hold for `cfg` (e.g. a q_proj bias when attention_bias is off), or None."""
    for rule in family.rules:
        if rule.when is None or condition_holds(rule.when, cfg, family):
            continue
        pattern = re.escape(rule.hf).replace(re.escape("{layer}"), r"\d+")
        if re.fullmatch(pattern, name):
            return rule
    return None


def family_mismatch(family: Family, model_type: object) -> str | None:
    """Why config.json's `model_type` does not select `family`, or None when it does."""
    from mappings.registry import family_for_model_type

    try:
        selected = family_for_model_type(model_type)
    except MappingError as err:
        return f"config.json: {err}"
    if selected != family.name:
        return (
            f"config.json model_type {model_type!r} selects the {selected} family, not "
            f"{family.name}: check it with --family {selected}"
        )
    return None


def vllm_packed_modules(hf_config: Mapping[str, Any]) -> dict[str, tuple[str, ...]] | None:
    """vLLM's `packed_modules_mapping` for the checkpoint's architecture, or None when vLLM
    is not installed or does not know the architecture. Imports vLLM lazily, its loggers at
    ERROR meanwhile (its platform notes, e.g. "Triton is installed, but doesn't include CPU
    backend", are not the checker's findings)."""
    import logging

    quiet = logging.getLogger("vllm")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _packed_modules(hf_config)
    finally:
        quiet.setLevel(level)


def _packed_modules(hf_config: Mapping[str, Any]) -> dict[str, tuple[str, ...]] | None:
    try:
        from vllm.model_executor.models import ModelRegistry
    except Exception:
        return None
    for arch in hf_config.get("architectures") or []:
        try:
            cls = ModelRegistry._try_load_model_cls(arch)  # noqa: SLF001
        except Exception:
            cls = None
        if cls is not None:
            packed = getattr(cls, "packed_modules_mapping", {}) or {}
            return {k: tuple(v) for k, v in packed.items()}
    return None


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every ``*.safetensors`` file in `folder`, from the headers only
    (numpy framework: no JAX, torch or tensor data).

    Raises:
        FileNotFoundError: the folder holds no safetensors file.
    """
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors file")
    out: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def check_folder(
    family: Family, folder: str | Path, with_engine: bool = True, with_jax: bool = True
) -> CheckReport:
    """Checks `family` against an HF folder: config.json, safetensors headers, the JAX model's
    abstract param shapes (`with_jax`; False imports no JAX: an engine process checks its
    model so) and (`with_engine`, where vLLM is installed) vLLM's packed modules."""
    from models.config import ModelConfig

    hf_config = json.loads((Path(folder) / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf_config)
    if family.tied is not None:
        cfg = cfg.replace(tie_word_embeddings=family.tied)
    shapes = checkpoint_shapes(folder)
    jax_shapes = None
    if with_jax:
        from models.params import abstract_params

        jax_shapes = {k: tuple(v.shape) for k, v in abstract_params(cfg).items()}
    packed = vllm_packed_modules(hf_config) if with_engine else None
    report = check_mapping(family, cfg, shapes, jax_shapes, packed)
    wrong = family_mismatch(family, hf_config.get("model_type"))
    if wrong:
        report.family_mismatch.append(wrong)
    return report
