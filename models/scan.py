"""The decoder's layer stack run as one `jax.lax.scan` over stacked params, with remat.

Legend: L layers, B batch, T tokens, D model width.

The params stay per layer (`layers.{i}....`, the layout the mappings, the data plane and the JAX
engine address); `scan_blocks` stacks them along a leading [L] axis inside the traced function
and scans one block's body over that axis (MaxText's and jax-llm-examples' scanned layers), so
the traced program holds one layer body, not one per layer (on XLA:CPU the compile seconds
still grew with depth and stayed above the loop's: `benchmarks/model_scale.py`; the params
stay separate leaves per layer, so the stacking, its transpose and the optimizer's update are
still written once per layer: the compiled step of a tiny 64-wide model held about 1,100 HLO
lines per layer scanned against 2,200 looped). The cost:
the stacking is one transient copy of the layer params per forward (and its transpose, one
gather of the [L, ...] gradients back into per-layer leaves, in the backward pass): L x (params
of one layer) bytes in the param dtype (1.2-1.3x the loop's peak RSS at SmolLM2-360M).

Layers whose block differs in static attributes (gemma3's sliding-window layers next to global
ones: `Attention.sliding` picks the window and the rope) get one body each, and the scan takes
the layer's kind as a scanned int input and picks the body with `jax.lax.switch`, so the program
still holds one body per kind, not one per layer.

Remat (gradient checkpointing, Chen et al. 2016, arXiv:1604.06174) wraps the body in
`jax.checkpoint` with one of `jax.checkpoint_policies` (`REMAT_POLICIES`): the backward pass
recomputes what the policy does not save, trading compute for activation memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

#: Remat policy names (config `model.remat`) -> `jax.checkpoint` policy; "none" is no remat,
#: "full" saves nothing (every activation of a layer is recomputed in the backward pass).
REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}

BlockFn = Callable[[nnx.Module, jax.Array], jax.Array]
#: A layer with per-layer input and output: (block, h [B, T, D], input i) -> (h, output i).
LayerFn = Callable[[nnx.Module, jax.Array, Any], tuple[jax.Array, Any]]


class LayerIO(Protocol):
    """What goes into and comes out of each layer besides its hidden states (routing replay:
    `models.routing.RoutingIO`), so that a scanned or rematerialised layer, which runs as a
    pure function of its params, still takes it and gives it back.

    Attributes:
        inputs: one per layer (a pytree of arrays or None), for a looped run.
        stacked_inputs: the same with a leading [L] axis (or None), for a scanned run.
    """

    inputs: list[Any]
    stacked_inputs: Any

    def enter(self, block: nnx.Module, xi: Any) -> None:
        """Give the layer `block` (as it runs) its input `xi`."""

    def leave(self, block: nnx.Module) -> Any:
        """Take the layer's output from `block` after it ran (a pytree of arrays or None;
        the same structure for every layer of a scan)."""


def remat_policy(name: str) -> Callable[..., Any] | None:
    """The `jax.checkpoint` policy of a remat name (None for "none").

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {name!r}; known: {sorted(REMAT_POLICIES)}")
    return REMAT_POLICIES[name]


def with_remat(fn: Callable[..., Any], remat: str) -> Callable[..., Any]:
    """`fn` wrapped in `jax.checkpoint` with the policy named `remat` ("none": `fn` itself).

    Raises:
        ValueError: an unknown remat name.
    """
    policy = remat_policy(remat)
    if remat == "none":
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=False)


def loop_blocks(blocks: Sequence[nnx.Module], x: jax.Array, call: BlockFn, remat: str) -> jax.Array:
    """`loop_layers_io` of `call(block, x)` with no per-layer input or output."""
    return loop_layers_io(
        blocks, x, lambda b, h, _: (call(b, h), None), remat, [None] * len(blocks)
    )[0]


def scan_blocks(blocks: Sequence[nnx.Module], x: jax.Array, call: BlockFn, remat: str) -> jax.Array:
    """`scan_layers_io` of `call(block, x)` with no per-layer input or output."""
    return scan_layers_io(blocks, x, lambda b, h, _: (call(b, h), None), remat)[0]


def loop_layers_io(
    blocks: Sequence[nnx.Module], x: jax.Array, call: LayerFn, remat: str, xs: Sequence[Any]
) -> tuple[jax.Array, list[Any]]:
    """Runs `call(block, x, xs[i])` for each block in turn (a Python loop: the program holds
    every layer), each layer under `remat`. x: [B, T, D] -> [B, T, D]; returns it and each
    layer's output (a pytree of arrays or None). Without remat each block is called in place,
    so variables a layer sets while running stay on it unless `call` removes them; under remat
    the layer runs as a pure function of its state and such variables are dropped (return
    what a layer records as its output: `models.routing`).

    Raises:
        ValueError: an unknown remat name, or `xs` not one entry per block.
    """
    if len(xs) != len(blocks):
        raise ValueError(f"loop_layers_io: {len(xs)} per-layer inputs for {len(blocks)} layers")
    ys = []
    for i, block in enumerate(blocks):
        if remat == "none":  # called in place
            with jax.named_scope(f"layer_{i}"):
                x, y = call(block, x, xs[i])
            ys.append(y)
            continue
        graphdef, state = nnx.split(block)
        body = with_remat(lambda s, h, xi, g=graphdef: call(nnx.merge(g, s), h, xi), remat)
        with jax.named_scope(f"layer_{i}"):
            x, y = body(state, x, xs[i])
        ys.append(y)
    return x, ys


def scan_layers_io(
    blocks: Sequence[nnx.Module], x: jax.Array, call: LayerFn, remat: str, xs: Any = None
) -> tuple[jax.Array, Any]:
    """Runs `call(block, x, xs_i)` over the blocks as one `jax.lax.scan` over their stacked
    params (module docstring), each step under `remat`. x: [B, T, D] -> [B, T, D] in x's
    dtype. `xs`: a pytree of arrays with a leading [L] axis (layer i gets its slice i), or None
    (every layer gets None). Returns x and the layers' outputs stacked along a leading [L].

    Blocks must share their param tree (names, shapes, dtypes); those with different static
    attributes (graph definitions) become separate bodies picked by `jax.lax.switch`.

    Raises:
        ValueError: no blocks, blocks whose param trees differ, or an unknown remat name.
    """
    if not blocks:
        raise ValueError("scan_blocks needs at least one block")
    splits = [nnx.split(b) for b in blocks]
    kinds: list[Any] = []
    kind_of = []
    for graphdef, _ in splits:
        if graphdef not in kinds:
            kinds.append(graphdef)
        kind_of.append(kinds.index(graphdef))
    states = [s for _, s in splits]
    first = str(jax.tree.structure(states[0]))
    for i, s in enumerate(states):
        if str(jax.tree.structure(s)) != first:
            raise ValueError(f"layer {i}'s param tree differs from layer 0's: cannot scan them")
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)  # [L, ...] per leaf

    def one(graphdef: Any) -> Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]:
        return lambda s, h, xi: call(nnx.merge(graphdef, s), h, xi)

    branches = [one(g) for g in kinds]

    def apply(s: Any, h: jax.Array, xi: Any, kind: jax.Array) -> tuple[jax.Array, Any]:
        if len(branches) == 1:
            return branches[0](s, h, xi)
        return jax.lax.switch(kind, branches, s, h, xi)

    body = with_remat(apply, remat)

    def step(h: jax.Array, inputs: tuple[Any, Any, jax.Array]) -> tuple[jax.Array, Any]:
        s, xi, kind = inputs
        out, y = body(s, h, xi, kind)
        return out.astype(h.dtype), y

    kind_arr = jnp.asarray(kind_of, jnp.int32)  # [L]
    return jax.lax.scan(step, x, (stacked, xs, kind_arr))
