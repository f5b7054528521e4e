"""Every family the mappings support, through a real vLLM CPU engine: start on tiny model A,
push tiny model B over gloo from a sender process, then vLLM's greedy tokens equal
transformers' for B and its processed log-probs at temperature 0.7 equal B's within 1e-4.

Families: SmolLM2 and Llama-3 (tied embeddings, GQA, llama3 RoPE scaling), Qwen2 (q/k/v biases,
GQA), Qwen3 (q/k norms, tied), Gemma3 (sliding window, tied, (1 + w) norms). Plain Llama is
covered by test_vllm_weight_update.py. One engine at a time, one per family.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from rollout_engine.backend import SamplingConfig, VersionSpan

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
FAMILIES = ["smollm2", "llama3", "qwen2", "qwen3", "gemma3"]
PROMPTS = [[5, 9, 23, 7, 40, 41], [17, 3, 99, 100, 12, 8, 200, 31]]


def _load_helpers():
    path = Path(__file__).with_name("vllm_helpers.py")
    spec = importlib.util.spec_from_file_location("vllm_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


H = _load_helpers()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from trainer.checkpoints.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    a = make_tiny_checkpoint(root / "A", request.param, seed=1)
    b = make_tiny_checkpoint(root / "B", request.param, seed=2)
    for loop, backend, sender in H.engine_world(a):
        yield {"loop": loop, "backend": backend, "sender": sender, "B": b, "hf": H.hf_model(b)}


def test_pushed_weights_match_transformers(family):
    loop, backend, sender = family["loop"], family["backend"], family["sender"]
    manifest = sender.offer("send", family["B"], 1, 1 << 16)
    stats = loop.run_until_complete(backend.update_weights(manifest))
    kind, rest = sender.result()
    assert kind == "done" and json.loads(rest)["version"] == 1 and stats.version == 1
    greedy = SamplingConfig(n=1, max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        res = loop.run_until_complete(backend.generate(f"g{i}", prompt, greedy))
        assert list(res.samples[0].token_ids) == H.hf_greedy(family["hf"], prompt, 10)
        assert res.samples[0].versions == (VersionSpan(1, 0, 10),)
    hot = SamplingConfig(n=2, max_tokens=12, temperature=0.7, seed=7, ignore_eos=True)
    res = loop.run_until_complete(backend.generate("t", PROMPTS[0], hot))
    for s in res.samples:
        ref = H.hf_logprobs(family["hf"], PROMPTS[0], list(s.token_ids), 0.7)
        assert max(abs(x - y) for x, y in zip(s.logprobs, ref, strict=True)) < 1e-4
