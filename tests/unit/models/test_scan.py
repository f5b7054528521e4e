"""Scanned layers (`models.scan`) against the Python loop: logits and parameter gradients of
every family's tiny model, fp32, without and with remat; and the faults (bad remat name, layers
that cannot be stacked)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from models.params import flat_params
from models.scan import REMAT_POLICIES, remat_policy, scan_blocks
from trainer.train_step import ModelTemplate

T = 11
TOL = 1e-5


@pytest.mark.parametrize("remat", ["none", "full", "dots_saveable"])
def test_scan_equals_loop_in_logits_and_grads(family_variant, tiny_checkpoint, remat):
    """Every family (gemma3: sliding and global layers, two scanned bodies), 2 rows of 11
    tokens, fp32: logits of the scan within 1e-5 of the loop's (relative to the largest |logit|,
    at least 1), and every param gradient of sum(logits * w) within 1e-5 relative to that
    gradient's largest entry. The loop without remat is the reference of every case."""
    _, variant = family_variant
    cfg, model = load_hf_checkpoint(tiny_checkpoint(variant))
    assert cfg.dtype == "float32"
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (2, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    weights = jnp.asarray(rng.normal(size=(2, T, cfg.vocab_size)), jnp.float32)
    params = flat_params(model)
    template = ModelTemplate(model)

    def loss(p, scan, rm):
        m = template.merge(p)
        h, _ = m.hidden(tokens, positions, scan_layers=scan, remat=rm)
        logits = m.logits(h)  # [2, T, V] float32
        return jnp.sum(logits * weights), logits

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(1, 2))
    (_, ref), g_ref = grad(params, False, "none")
    (_, got), g_got = grad(params, True, remat)
    (_, loop_remat), g_loop_remat = grad(params, False, remat)
    assert got.dtype == jnp.float32 and got.shape == (2, T, cfg.vocab_size)
    scale = max(1.0, float(jnp.abs(ref).max()))
    assert float(jnp.abs(got - ref).max()) <= TOL * scale
    assert float(jnp.abs(loop_remat - ref).max()) <= TOL * scale
    assert set(g_got) == set(g_ref)
    for name in g_ref:
        s = max(1e-6, float(jnp.abs(g_ref[name]).max()))
        assert g_got[name].dtype == jnp.float32, name
        assert float(jnp.abs(g_got[name] - g_ref[name]).max()) <= TOL * s, name
        assert float(jnp.abs(g_loop_remat[name] - g_ref[name]).max()) <= TOL * s, name


def test_bad_remat_name_is_refused(tiny_checkpoint):
    """An unknown policy name fails at once, naming the known ones, in the model and in
    `remat_policy`."""
    _, model = load_hf_checkpoint(tiny_checkpoint("llama"))
    tokens = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="unknown remat policy 'dots'.*dots_saveable"):
        model.hidden(tokens, positions, scan_layers=True, remat="dots")
    with pytest.raises(ValueError, match="unknown remat policy"):
        remat_policy("everything")
    assert remat_policy("none") is None
    assert set(REMAT_POLICIES) >= {"none", "full", "dots_saveable"}


def test_layers_with_different_param_trees_are_refused():
    """Blocks whose params differ in structure cannot share a scan: a clear error names the
    layer; an empty stack is refused too."""

    class Lin(nnx.Module):
        def __init__(self, bias: bool):
            self.w = nnx.Param(jnp.ones((3, 3)))
            if bias:
                self.b = nnx.Param(jnp.zeros((3,)))

    x = jnp.ones((1, 2, 3))
    with pytest.raises(ValueError, match="layer 1's param tree differs"):
        scan_blocks([Lin(False), Lin(True)], x, lambda m, h: h @ m.w[...], "none")
    with pytest.raises(ValueError, match="at least one block"):
        scan_blocks([], x, lambda m, h: h, "none")
