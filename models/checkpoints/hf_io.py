"""HF safetensors folders in and out of the JAX Decoder, through the family's mapping.

Loading reads one tensor at a time (single `model.safetensors` or sharded with
`model.safetensors.index.json`), maps it, casts it to the param dtype and places it,
optionally straight onto a mesh, sharded by each param's logical axes, so the whole model never
sits on one
device. Export writes `config.json` and `model.safetensors` that transformers and vLLM load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.flax import save_file

from mappings.apply import checkpoint_to_params, params_to_engine
from mappings.registry import get_family
from models.config import ModelConfig
from models.decoder import Decoder
from models.params import abstract_axes, flat_params, model_from_params
from models.sharding import check_tp, param_sharding, place

#: safetensors dtype names -> the numpy dtype of a view (`CheckpointReader.view`).
_VIEW_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


class CheckpointReader:
    """Random access to the tensors of an HF safetensors folder by name.

    Raises:
        FileNotFoundError: no `model.safetensors` nor `model.safetensors.index.json` in `path`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handles: dict[Path, Any] = {}
        self._maps: dict[Path, tuple[np.ndarray, int, dict[str, Any]]] = {}
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / f for name, f in weight_map.items()}
        elif (self.path / "model.safetensors").exists():
            single = self.path / "model.safetensors"
            with safe_open(single, framework="flax") as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.path}: expected model.safetensors or model.safetensors.index.json"
            )

    def names(self) -> set[str]:
        """Every tensor name in the checkpoint."""
        return set(self.files)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape, read from the headers only (no tensor data)."""
        out: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    out[name] = tuple(f.get_slice(name).get_shape())
        return out

    def read(self, name: str) -> np.ndarray:
        """One tensor as numpy (bf16 as ml_dtypes.bfloat16). Raises KeyError naming it.

        Reads through numpy (memory-mapped, no device round trip); bf16, which numpy's
        reader does not take, goes through the flax reader.
        """
        if name not in self.files:
            raise KeyError(f"tensor {name} is not in checkpoint {self.path}")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="np")
        handle = self._handles[file]
        if handle.get_slice(name).get_dtype() != "BF16":
            return handle.get_tensor(name)
        with safe_open(file, framework="flax") as f:
            return np.asarray(f.get_tensor(name))

    def view(self, name: str) -> np.ndarray:
        """One tensor as a read-only view of its bytes in the memory-mapped file: nothing is
        read until its elements are (then only the pages they sit on). Layout from the
        safetensors header (8-byte little-endian header length, JSON header, data:
        https://github.com/huggingface/safetensors#format).

        Raises:
            KeyError: the name is not in the checkpoint. ValueError: a dtype numpy has no
                view of (the dtype named).
        """
        if name not in self.files:
            raise KeyError(f"tensor {name} is not in checkpoint {self.path}")
        file = self.files[name]
        if file not in self._maps:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            self._maps[file] = (np.memmap(file, dtype=np.uint8, mode="r"), 8 + size, header)
        raw, base, header = self._maps[file]
        entry = header[name]
        dtype = _VIEW_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{name}: no numpy view of safetensors dtype {entry['dtype']}")
        start, stop = (base + int(x) for x in entry["data_offsets"])
        return raw[start:stop].view(dtype).reshape(entry["shape"])


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of an HF folder. Raises FileNotFoundError naming the path."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file} does not exist; an HF checkpoint folder has one")
    return json.loads(file.read_text())


def load_hf_checkpoint(
    path: str | Path,
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    mesh: Mesh | None = None,
    min_shard_bytes: int = 1 << 16,
    residual_dtype: str = "float32",
) -> tuple[ModelConfig, Decoder]:
    """Loads an HF safetensors folder into a Decoder.

    Args:
        path: folder with config.json and model.safetensors (or a sharded index).
        dtype: compute dtype; param_dtype: storage dtype (default: dtype).
        mesh: if given, a ("dp", "fsdp", "tp") mesh, possibly over several processes; each
            param is placed by its logical axes as it is read (`models.sharding.param_sharding`),
            never whole on one
            device first, and each process copies out of the memory-mapped file only the
            slices its devices hold, cast one slice at a time (`CheckpointReader.view`, the
            mapping's layout change as a numpy view, `models.sharding.place`); no process
            holds a whole tensor of its own, except where the layout change cannot be a view
            (a padded axis) or a param is replicated (under `min_shard_bytes`).
        min_shard_bytes: params smaller than this are replicated.
        residual_dtype: the residual stream's dtype, float32 or `dtype`
            (`models.config.ModelConfig`).

    Returns:
        (config, model).

    Raises:
        UnsupportedModelError: unknown model_type or dtype (lists the supported ones).
        MappingError: a tensor the family needs is missing (named) or has the wrong shape.
        MeshError: the mesh's "tp" does not divide the heads or KV heads (the numbers named).
    """
    cfg = ModelConfig.from_hf(
        read_hf_config(path), dtype=dtype, param_dtype=param_dtype, residual_dtype=residual_dtype
    )
    reader = CheckpointReader(path)
    family = get_family(cfg.family)
    target = jnp.dtype(cfg.param_dtype)
    loaded: dict[str, jax.Array] = {}
    if mesh is None:
        for rule, array in checkpoint_to_params(family, cfg, reader.read, reader.names()):
            loaded[rule.jax] = jnp.asarray(array.astype(target, copy=False))
        return cfg, model_from_params(cfg, loaded)
    check_tp(cfg, mesh.shape.get("tp", 1))
    axes = abstract_axes(cfg)
    views = checkpoint_to_params(family, cfg, reader.view, reader.names(), contiguous=False)
    for rule, view in views:
        sharding = param_sharding(axes[rule.jax] or (), view.shape, target, mesh, min_shard_bytes)
        loaded[rule.jax] = place(view, sharding, target)
    return cfg, model_from_params(cfg, loaded)


def export_tensors(model: Decoder, dtype: str | None = None) -> dict[str, np.ndarray]:
    """The HF-named tensors of `model` (numpy, gathered to host), cast to `dtype` if given."""
    cfg = model.cfg
    family = get_family(cfg.family)
    params = {k: np.asarray(jax.device_get(v)) for k, v in flat_params(model).items()}
    cast = None if dtype is None else (lambda a: a.astype(jnp.dtype(dtype)))
    return dict(params_to_engine(family, cfg, params, cast=cast))


def save_hf_checkpoint(
    model: Decoder,
    path: str | Path,
    *,
    hf_config: dict[str, Any],
    dtype: str | None = None,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Writes `model` as an HF folder (config.json, model.safetensors) that transformers and
    vLLM load.

    Args:
        hf_config: the checkpoint's original config dict (written back, with `torch_dtype`
            / `dtype` set to the saved dtype).
        dtype: tensor dtype on disk (default: the params' dtype).
        tokenizer_from: a folder whose tokenizer files are copied beside the weights.

    Returns:
        The folder path.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(model, dtype)
    saved_dtype = dtype or model.cfg.param_dtype
    config = dict(hf_config, torch_dtype=saved_dtype, dtype=saved_dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: jnp.asarray(v) for k, v in tensors.items()},
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_from) / name
            if src.exists():
                shutil.copy(src, out / name)
    return out
