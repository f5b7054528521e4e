"""The engine-side manifest reference (checkpoint headers) and the explicit registration."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from transport.expected import checkpoint_tensors
from transport.manifest import Manifest, ManifestError, check_manifest


def test_checkpoint_tensors_reads_headers_only(tmp_path):
    save_file(
        {"a.weight": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)},
        str(tmp_path / "model-00001.safetensors"),
        metadata={"format": "pt"},
    )
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "model-00002.safetensors"))
    got = checkpoint_tensors(tmp_path, "bfloat16")
    assert got == {
        "a.weight": ((3, 4), "bfloat16"),
        "b": ((5,), "bfloat16"),
        "c": ((2, 2, 2), "bfloat16"),
    }
    ok = Manifest.of(1, [("a.weight", (3, 4)), ("b", (5,)), ("c", (2, 2, 2))], "bfloat16", 64)
    check_manifest(ok, got)
    f32 = Manifest.of(1, [(t.name, t.shape) for t in ok.tensors], "float32", 64)
    with pytest.raises(ManifestError, match=r"c: dtype float32, expected bfloat16"):
        check_manifest(f32, got)


def test_checkpoint_tensors_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_tensors(tmp_path, "float32")
    (tmp_path / "x.safetensors").write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(ValueError, match="not a safetensors header"):
        checkpoint_tensors(tmp_path, "float32")


@pytest.mark.vllm
def test_importing_the_backend_registers_nothing_and_register_is_idempotent():
    code = (
        "import rollout_engine.vllm.backend, rollout_engine.vllm.registry as r\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
        "assert r.ENGINE_NAME not in F._registry\n"
        "r.register_transfer_engines(); r.register_transfer_engines()\n"
        "cls = F._registry[r.ENGINE_NAME]()\n"
        "assert cls.__name__ == 'JaxrlWeightTransferEngine', cls\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_num_kv_heads_reads_config_json(tmp_path):
    import json

    from transport.expected import num_kv_heads

    cases = [
        ({"num_key_value_heads": 2, "num_attention_heads": 8}, 2),
        ({"num_attention_heads": 8}, 8),  # multi-head attention: as many KV heads
        ({"text_config": {"num_key_value_heads": 4}}, 4),
        ({"hidden_size": 64}, None),
    ]
    for cfg, want in cases:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert num_kv_heads(tmp_path) == want, cfg
    with pytest.raises(FileNotFoundError):
        num_kv_heads(tmp_path / "missing")
