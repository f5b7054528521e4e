"""The fused log-prob kernel equals the naive path in values and gradients, without [N, V]."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.logprobs import fused_target_logprobs, naive_target_logprobs


def _problem(n=10, d=8, v=37, seed=0, lead=None):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    shape = (n,) if lead is None else lead
    hidden = jax.random.normal(k1, (*shape, d), jnp.float32)
    w = jax.random.normal(k2, (d, v), jnp.float32) * 0.5
    targets = jax.random.randint(k3, shape, 0, v, jnp.int32)
    cot = jax.random.normal(k4, shape, jnp.float32)  # a cotangent that mixes every row
    return hidden, w, targets, cot


def _grads(fn, hidden, w, targets, cot, **kw):
    def f(h, w_):
        return jnp.sum(fn(h, w_, targets, **kw) * cot)

    return jax.grad(f, argnums=(0, 1))(hidden, w)


@pytest.mark.parametrize("chunk_size", [1, 4, 10, 64])
@pytest.mark.parametrize(("temperature", "softcap"), [(1.0, None), (0.7, None), (0.7, 2.0)])
def test_fused_equals_naive_values_and_grads(chunk_size, temperature, softcap):
    # N = 10 rows: chunk 4 leaves a partial last chunk (4 + 4 + 2), 64 > N is one chunk
    hidden, w, targets, cot = _problem()
    kw = dict(temperature=temperature, softcap=softcap)
    fused = fused_target_logprobs(hidden, w, targets, chunk_size=chunk_size, **kw)
    naive = naive_target_logprobs(hidden, w, targets, **kw)
    assert fused.shape == (10,) and fused.dtype == jnp.float32
    np.testing.assert_allclose(fused, naive, rtol=1e-5, atol=1e-5)
    g_fused = _grads(fused_target_logprobs, hidden, w, targets, cot, chunk_size=chunk_size, **kw)
    g_naive = _grads(naive_target_logprobs, hidden, w, targets, cot, **kw)
    for a, b in zip(g_fused, g_naive, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_batch_time_shape_and_jit():
    hidden, w, targets, cot = _problem(d=16, v=53, lead=(3, 7), seed=1)
    fn = jax.jit(lambda h, w_, y: fused_target_logprobs(h, w_, y, chunk_size=4, temperature=0.9))
    out = fn(hidden, w, targets)
    assert out.shape == (3, 7)
    naive = naive_target_logprobs(hidden, w, targets, temperature=0.9)
    np.testing.assert_allclose(out, naive, rtol=1e-5, atol=1e-5)
    gf = jax.jit(lambda h, w_: _grads(fused_target_logprobs, h, w_, targets, cot, chunk_size=4))
    for a, b in zip(
        gf(hidden, w), _grads(naive_target_logprobs, hidden, w, targets, cot), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_known_value_uniform_logits():
    # zero hidden states give equal logits: every log-prob is -ln V
    out = fused_target_logprobs(jnp.zeros((5, 4)), jnp.ones((4, 8)), jnp.arange(5), chunk_size=2)
    np.testing.assert_allclose(out, np.full(5, -np.log(8.0)), rtol=1e-6)


def test_bf16_inputs_give_f32_logprobs_and_grads_in_input_dtype():
    hidden, w, targets, cot = _problem()
    hb, wb = hidden.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    out = fused_target_logprobs(hb, wb, targets, chunk_size=4)
    assert out.dtype == jnp.float32
    # the head runs in f32 on the bf16 values: equal to the naive path on the upcast inputs
    naive = naive_target_logprobs(hb.astype(jnp.float32), wb.astype(jnp.float32), targets)
    np.testing.assert_allclose(out, naive, rtol=1e-5, atol=1e-5)
    dh, dw = _grads(fused_target_logprobs, hb, wb, targets, cot, chunk_size=4)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16


def _max_intermediate_size(jaxpr) -> int:
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            biggest = max(biggest, _max_intermediate_size(sub))
    return biggest


def test_never_materialises_n_by_v():
    # N = 64, C = 8, V = 97, D = 16: naive needs N * V = 6208 elements, fused at most
    # max(C * V, D * V) = 1552 (the dW accumulator) in forward and backward
    hidden, w, targets, cot = _problem(n=64, d=16, v=97)
    fused = jax.make_jaxpr(
        lambda h, w_: _grads(fused_target_logprobs, h, w_, targets, cot, chunk_size=8)
    )(hidden, w)
    naive = jax.make_jaxpr(lambda h, w_: _grads(naive_target_logprobs, h, w_, targets, cot))(
        hidden, w
    )
    assert _max_intermediate_size(fused.jaxpr) == 16 * 97
    assert _max_intermediate_size(naive.jaxpr) == 64 * 97


def test_sharded_rows_on_8_devices():
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        pytest.skip("needs 8 (host) devices")
    mesh = jax.sharding.Mesh(devices, ("dp",))
    hidden, w, targets, cot = _problem(n=64, d=16, v=97, seed=3)
    hs = jax.device_put(hidden, NamedSharding(mesh, P("dp", None)))
    ys = jax.device_put(targets, NamedSharding(mesh, P("dp")))
    out = jax.jit(lambda h, w_, y: fused_target_logprobs(h, w_, y, chunk_size=16))(hs, w, ys)
    np.testing.assert_allclose(out, naive_target_logprobs(hidden, w, targets), atol=1e-5)
    # the LM head sharded over D as FSDP shards it: same values and gradients
    ws = jax.device_put(w, NamedSharding(mesh, P("dp", None)))
    g = jax.jit(lambda h, w_: _grads(fused_target_logprobs, h, w_, ys, cot, chunk_size=16))(hs, ws)
    for a, b in zip(g, _grads(naive_target_logprobs, hidden, w, targets, cot), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise():
    h, w, y = jnp.zeros((4, 8)), jnp.zeros((8, 5)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"w must be \[D=8, V\]"):
        fused_target_logprobs(h, jnp.zeros((7, 5)), y)
    with pytest.raises(ValueError, match="targets must be"):
        fused_target_logprobs(h, w, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        fused_target_logprobs(h, w, jnp.zeros((4,)))
    with pytest.raises(ValueError, match="temperature"):
        fused_target_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        fused_target_logprobs(h, w, y, softcap=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_target_logprobs(h, w, y, chunk_size=0)
