"""Logical axes: the one table from a param's or activation's named axes to the train mesh's
axes ("dp", "fsdp", "ep", "tp") and to the engine's tensor-parallel shard kind.

Every param of the decoder declares its logical axes once, where it is created, as flax NNX's
own `out_sharding` metadata (`param`); placement (`models.sharding.param_sharding`), the
activations' sharding constraints (`constrain`) and the data plane's shard kind (`shard_kind`)
all read `LOGICAL_AXIS_RULES`, and nothing else names a mesh axis or guesses a sharded
dimension. The scheme is MaxText's logical axis rules (a logical name -> mesh axes, first
unused one wins, flax's `logical_to_mesh_axes`) with Megatron-LM's tensor parallelism
(Shoeybi et al. 2019, arXiv:1909.08053): attention heads, KV heads, the MLP width and the
vocab over "tp"; the model width `embed` of every param over "fsdp" (ZeRO-3, Rajbhandari et
al. 2020); the batch over ("dp", "fsdp", "ep").

Expert parallelism (GShard, Lepikhin et al. 2020, arXiv:2006.16668; DeepSpeed-MoE, Rajbhandari
et al. 2022): the stacked `experts` axis of every expert param (and the router's output) is
split over its own mesh axis "ep", and the batch's rows are split over "ep" too, so an "ep"
group is data-parallel for every non-expert param and holds E / ep whole experts. A separate
axis rather than experts over "fsdp" (MaxText's and torchtitan's alternative) because then an
expert param keeps its `embed` split over "fsdp" as well (ZeRO-3 within an expert group) and
ep can be chosen apart from fsdp (ep must divide E; fsdp need not). With Auto mesh axes XLA's
SPMD partitioner inserts the token exchange the dispatch needs; the result is the one-device
result (tests/unit/trainer/step/test_ep_step.py).

Param axes (kernels are [inputs..., outputs...]):
    embed     D, the model width of a param (sharded over fsdp)
    heads     N, query heads;  kv_heads  K, key/value heads;  head_dim  H (never sharded)
    mlp       F, the MLP width;  vocab  V, the vocabulary
    norm      D of a norm scale: over fsdp like every param's width (ZeRO-3 shards every
              param), never over tp (every TP rank needs it whole: shard kind "replicated")
    experts   E, the stacked experts of a mixture-of-experts param (sharded over ep)
    lora_io, lora_rank: the feature and rank dims of a LoRA adapter's A [I, r] / B [r, O]
              (`models.lora`; small, replicated)
    layers: reserved (stacked layers); maps to nothing yet.
Activation axes: batch (B rows), length (T), act_embed (D of an activation: replicated over
tp, as Megatron keeps it between the column- and the row-parallel matmul), and heads,
kv_heads, head_dim, mlp, vocab as for params.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from flax.linen import logical_to_mesh_axes
from jax.sharding import NamedSharding, PartitionSpec

from mappings.shards import ShardKind

#: The train mesh's axes, outermost first.
MESH_AXES: tuple[str, str, str, str] = ("dp", "fsdp", "ep", "tp")

#: Logical axis -> mesh axis (or axes, or None: replicated). MaxText-style rules; the one table.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("dp", "fsdp", "ep")),
    ("length", None),
    ("act_embed", None),
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("head_dim", None),
    ("norm", "fsdp"),
    ("layers", None),
    ("experts", "ep"),
    ("lora_io", None),
    ("lora_rank", None),
)
#: Every logical axis a param may declare.
PARAM_AXES: frozenset[str] = frozenset(
    (
        "embed",
        "heads",
        "kv_heads",
        "head_dim",
        "mlp",
        "vocab",
        "norm",
        "layers",
        "experts",
        "lora_io",
        "lora_rank",
    )
)
#: The logical axes "tp" splits, by the engine TP shard kind they make (`mappings.shards`).
_TP_KIND: dict[str, ShardKind] = {"vocab": "vocab", "kv_heads": "kv", "heads": "column"}


def param(value: jax.Array, axes: Sequence[str]) -> nnx.Param:
    """An `nnx.Param` holding `value` whose logical axes are `axes` (one name per dim), kept as
    flax's `out_sharding` metadata (`nnx.with_partitioning`'s key). Placement is not eager:
    the model is built on no mesh and placed later by `models.sharding.param_sharding`.

    Raises:
        ValueError: `axes` does not name every dim, or names an axis outside `PARAM_AXES`.
    """
    axes = tuple(axes)
    if len(axes) != value.ndim or not set(axes) <= PARAM_AXES:
        raise ValueError(f"logical axes {axes} for a param of shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def axes_of(var: nnx.Variable) -> tuple[str, ...] | None:
    """The logical axes a param declared (`param`), or None when it declared none."""
    axes = var.get_metadata().get("out_sharding")
    return tuple(axes) if axes else None


def logical_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh_shape: dict[str, int]
) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` with logical `axes` on a mesh of `mesh_shape`
    (axis name -> size), through `LOGICAL_AXIS_RULES` (flax's `logical_to_mesh_axes`: a mesh
    axis is used at most once, the first logical axis that asks for it wins).

    Mesh axes the mesh lacks or of size 1 are left out (they split nothing).

    Raises:
        ValueError: a dim whose size the mesh axes it maps to do not divide (names the
            logical axis, its size and the mesh axes with their sizes).
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} for shape {tuple(shape)}")
    mapped = tuple(logical_to_mesh_axes(tuple(axes), LOGICAL_AXIS_RULES) or ())
    spec: list[Any] = []
    for name, size, target in zip(axes, shape, mapped, strict=True):
        names = (target,) if isinstance(target, str) else tuple(target or ())
        names = tuple(m for m in names if mesh_shape.get(m, 1) > 1)
        parts = 1
        for m in names:
            parts *= mesh_shape[m]
        if size % parts:
            split = " x ".join(f"{m}={mesh_shape[m]}" for m in names)
            raise ValueError(f"logical axis {name!r} of size {size} does not split over {split}")
        spec.append(None if not names else names[0] if len(names) == 1 else names)
    return PartitionSpec(*spec)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """`x` with a sharding constraint by logical `axes` on the mesh set by `jax.set_mesh`
    (the train step sets it); unchanged where no mesh is set (the JAX engine, tests on one
    device). Shapes and values never change, only where XLA keeps the pieces."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_spec(axes, x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def shard_kind(axes: Sequence[str]) -> ShardKind:
    """The engine TP shard kind (`mappings.shards`) of a param with logical `axes`: the kind
    follows from the one logical axis "tp" splits (the rules table) and its place.

    `vocab` -> "vocab"; `kv_heads` -> "kv"; `heads` or `mlp` -> "row" when it comes before
    `embed` (an input axis of the kernel: Megatron's row-parallel linear, o and down) and
    "column" otherwise (q, gate, up and their biases); no such axis -> "replicated" (norms,
    the output bias, q/k norms).
    """
    axes = tuple(axes)
    split = [a for a in axes if dict(LOGICAL_AXIS_RULES).get(a) == "tp"]
    if not split:
        return "replicated"
    axis = split[0]
    if axis in ("vocab", "kv_heads"):
        return _TP_KIND[axis]
    if "embed" in axes and axes.index(axis) < axes.index("embed"):
        return "row"
    return "column"
