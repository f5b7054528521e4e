"""The adapter facts of an adapter-only manifest: they travel in its JSON (and its
fingerprint), malformed ones are a `ManifestError`, and `check_adapter` says which side
differs."""

import dataclasses

import pytest

from transport.adapter_spec import AdapterMismatch, AdapterSpec, adapter_key, check_adapter
from transport.manifest import Manifest, ManifestError

SPEC = AdapterSpec.of(8, 16.0, ["v_proj", "q_proj", "q_proj"])


def test_the_adapter_travels_in_the_manifest_and_its_fingerprint():
    assert SPEC.targets == ("q_proj", "v_proj") and SPEC.scaling == 2.0
    m = dataclasses.replace(Manifest.of(3, [("a", (8, 4))], "float32", 64), adapter=SPEC)
    back = Manifest.from_json(m.to_json())
    assert back == m and back.adapter == SPEC
    assert m.to_dict()["adapter"] == {
        "r": 8,
        "lora_alpha": 16.0,
        "target_modules": ["q_proj", "v_proj"],
    }
    plain = dataclasses.replace(m, adapter=None)
    assert "adapter" not in plain.to_dict() and plain.fingerprint() != m.fingerprint()
    for bad in ({"r": 0, "lora_alpha": 1, "target_modules": ["q_proj"]},
                {"r": 4, "lora_alpha": float("nan"), "target_modules": ["q_proj"]},
                {"r": 4, "lora_alpha": 1, "target_modules": []},
                {"r": 4}):  # fmt: skip
        with pytest.raises(ManifestError):
            Manifest.from_dict({**m.to_dict(), "adapter": bad})


def test_check_adapter_names_what_differs():
    check_adapter(None, None, 1)
    check_adapter(SPEC, dataclasses.replace(SPEC, alpha=1.0), 1)  # alpha rides with the version
    with pytest.raises(AdapterMismatch, match="started without LoRA"):
        check_adapter(SPEC, None, 1)
    with pytest.raises(AdapterMismatch, match="carries full weights"):
        check_adapter(None, SPEC, 1)
    with pytest.raises(AdapterMismatch, match=r"rank 4, .* differs .* \(rank 8"):
        check_adapter(AdapterSpec.of(4, 16.0, SPEC.targets), SPEC, 1)
    with pytest.raises(AdapterMismatch, match=r"targets \['q_proj'\]\) differs"):
        check_adapter(AdapterSpec.of(8, 16.0, ["q_proj"]), SPEC, 1)
    assert adapter_key(8, ["v_proj", "q_proj"]) == "lora r=8 targets=q_proj,v_proj"
    assert adapter_key(0, ["q_proj"]) == ""
