"""A bf16 replica holding its projections packed once per weight version
(`BatcherConfig.packed_weights`, `models.packed`) samples the tokens of the one that packs them
per call, and its log-probs within 1e-5 (the LM head's products differ from XLA's in order),
before and after a weight update, and never decodes a new version with the old version's
packed copies."""

import jax
import numpy as np
import pytest
from flax import nnx

from models.decoder import Decoder
from models.kernels.build import cpu_flags
from models.packed import PackedKernel
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request

pytestmark = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags(), reason="no AVX512-BF16 on this CPU (XLA's dot serves)"
)


def _model(seed: int, tiny_split):
    cfg, _, _ = tiny_split("llama")
    cfg = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")  # as a bf16 checkpoint loads
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)))
    return cfg, graphdef, params


def _requests():
    rng = np.random.default_rng(5)
    return [
        Request(i, tuple(int(t) for t in rng.integers(1, 64, size=int(n))), 2, 24)
        for i, n in enumerate((4, 19, 33, 8))
    ]


def _batcher(model, packed_weights: bool, temperature: float) -> ContinuousBatcher:
    cfg, graphdef, params = model
    bcfg = BatcherConfig(num_slots=4, max_len=80, prefill_batch=2, packed_weights=packed_weights)
    return ContinuousBatcher(
        cfg, graphdef, params, bcfg, SamplingConfig(temperature=temperature), StopConfig((0,), 1)
    )


def _results(b: ContinuousBatcher):
    b.submit(_requests())
    return sorted(b.run_until_idle(), key=lambda r: (r.prompt_id, r.sample_index))


def _packed(b: ContinuousBatcher) -> list[jax.Array]:
    return jax.tree.leaves(nnx.filter_state(b.params, PackedKernel))


def _same(got, want):
    assert len(got) == len(want) == 8
    assert sum(len(r.tokens) for r in got) > 60  # decode ran, not only the first tokens
    for x, y in zip(got, want, strict=True):
        assert (x.prompt_id, x.sample_index) == (y.prompt_id, y.sample_index)
        assert x.weight_versions == y.weight_versions
        np.testing.assert_array_equal(x.tokens, y.tokens)
        # the layers' products are the same bit for bit; the LM head's, XLA's up to order
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_packed_once_samples_what_packing_per_call_samples(tiny_split, temperature):
    model = _model(0, tiny_split)
    on, off = _batcher(model, True, temperature), _batcher(model, False, temperature)
    assert len(_packed(on)) == 7 * model[0].num_layers + 1 and not _packed(off)
    _same(_results(on), _results(off))


def test_an_update_repacks_so_the_new_version_decodes_with_its_own_weights(tiny_split):
    old, new = _model(0, tiny_split), _model(1, tiny_split)
    b = _batcher(old, True, 0.0)
    before = _packed(b)
    _results(b)
    b.update_weights(new[2], version=1)
    got = _results(b)  # the update applies at the first safe point of this run
    after = _packed(b)
    assert all(v == 1 for r in got for v, _, _ in r.weight_versions)
    assert len(after) == len(before)
    for x, y in zip(after, before, strict=True):
        assert not np.array_equal(np.asarray(x), np.asarray(y))
    fresh = _batcher(new, False, 0.0)  # the new weights packed per call, from the start
    fresh.version = 1
    _same(got, _results(fresh))
