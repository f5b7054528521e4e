"""The tensors an engine's model takes, read from the headers of its HF checkpoint.

The manifest of every update is checked against this before anything is loaded: the same
names (the checkpoint's, which vLLM's `load_weights` takes), full shapes, and the engine dtype.
Reads only the safetensors JSON headers (no tensor data, no torch).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def num_kv_heads(model_dir: str | Path) -> int | None:
    """The model's KV heads from `model_dir/config.json` (`num_key_value_heads`, else
    `num_attention_heads`, looked up in `text_config` too), or None when it names neither.

    Raises:
        FileNotFoundError: no config.json.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        heads = c.get("num_key_value_heads") or c.get("num_attention_heads")
        if heads:
            return int(heads)
    return None


def checkpoint_tensors(model_dir: str | Path, dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (full shape, `dtype`) for every tensor in `model_dir/*.safetensors`.

    Args:
        model_dir: an HF checkpoint folder.
        dtype: the engine's dtype as torch names it (`"bfloat16"`, `"float32"`).

    Raises:
        FileNotFoundError: the folder holds no safetensors file.
        ValueError: a file whose header is not valid safetensors.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            try:
                header = json.loads(fh.read(n))
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}: not a safetensors header: {e}") from e
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (tuple(int(d) for d in meta["shape"]), dtype)
    return out
