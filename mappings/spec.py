"""The declarative parts of a mapping: rules, families, and the axis-pattern syntax.

A rule ties one JAX parameter path to one HF / vLLM tensor name. Both may contain the
`{layer}` template. Layouts are written in one einops-like syntax, for both directions:
a space-separated list of axes, where `(N H)` is one tensor axis made of two symbols.
For example the query projection is `hf="(N H) D"` (torch Linear: [out, in]) and
`jax="D N H"`; the transform (split the first axis into N and H, then move D first) and
its inverse follow from the two patterns, and every shape is checked against the
config's sizes (symbols D, F, N, K, H, V, L, E, M; see `ModelConfig.dims`).

Experts: an HF name with `{expert}` is one tensor per expert (`mlp.experts.{expert}.gate_proj.
weight`, "M D"), and its JAX param stacks them on a leading "E" axis ("E D M"): the rule
expands to E concrete rules, one per HF tensor, that share the JAX path.

Imports numpy only.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from mappings.shards import ShardKind

#: Condition names a rule may be gated by, evaluated on the model config.
CONDITIONS = ("attention_bias", "output_bias", "qk_norm", "qk_norm_full", "post_norms", "untied")

_TOKEN = re.compile(r"\(([^()]*)\)|(\S+)")


class MappingError(ValueError):
    """A mapping that does not fit a checkpoint or a param tree; the message names the tensor."""


def parse_axes(pattern: str) -> list[tuple[str, ...]]:
    """Parses "(N H) D" into [("N", "H"), ("D",)]: one tuple of symbols per tensor axis.

    Raises:
        MappingError: empty groups or unbalanced parentheses.
    """
    groups: list[tuple[str, ...]] = []
    pos = 0
    for match in _TOKEN.finditer(pattern):
        if pattern[pos : match.start()].strip():
            raise MappingError(f"cannot parse axis pattern {pattern!r}")
        pos = match.end()
        group = match.group(1)
        symbols = tuple(group.split()) if group is not None else (match.group(2),)
        if not symbols or any(s in "()" for s in symbols):
            raise MappingError(f"cannot parse axis pattern {pattern!r}")
        groups.append(symbols)
    if pattern[pos:].strip():
        raise MappingError(f"cannot parse axis pattern {pattern!r}")
    return groups


def shape_of(pattern: str, dims: Mapping[str, int]) -> tuple[int, ...]:
    """The concrete shape of a pattern, e.g. "(N H) D" with N=4, H=8, D=32 -> (32, 32).

    Raises:
        MappingError: a symbol that `dims` does not define.
    """
    out = []
    for group in parse_axes(pattern):
        missing = [s for s in group if s not in dims and not s.isdigit()]
        if missing:
            raise MappingError(f"axis symbols {missing} of {pattern!r} are not in {sorted(dims)}")
        out.append(math.prod(int(s) if s.isdigit() else dims[s] for s in group))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One tensor of a family.

    Attributes:
        jax: JAX param path, dot-separated, may contain `{layer}`.
        hf: HF checkpoint tensor name (also the name vLLM's `load_weights` takes).
        hf_axes: layout of the HF tensor, e.g. "(N H) D".
        jax_axes: layout of the JAX param, e.g. "D N H". The multiset of symbols must equal
            hf_axes'. An axis "V" may be padded on the JAX side (zero rows added on load,
            sliced off on export).
        tp_dim: the HF tensor's tensor-parallel shard axis in the engine: 0 for
            column-parallel (and vocab-parallel embeddings / LM head), 1 for row-parallel,
            None for replicated tensors (norms).
        fused: (engine tensor, shard id) when the engine stores this tensor inside a fused
            one, e.g. ("model.layers.{layer}.self_attn.qkv_proj.weight", "q").
        when: a condition of CONDITIONS that must hold on the config, or None.

    A rule whose `hf` holds `{expert}` maps E HF tensors (one per expert) into one JAX param
    whose first axis is "E" (the experts, stacked): `jax_axes` starts with "E" and the rest
    of it names the symbols of `hf_axes`.
    """

    jax: str
    hf: str
    hf_axes: str
    jax_axes: str
    tp_dim: int | None = None
    fused: tuple[str, str] | None = None
    when: str | None = None

    def __post_init__(self) -> None:
        if self.when is not None and self.when not in CONDITIONS:
            raise MappingError(f"rule {self.jax}: when={self.when!r} not in {CONDITIONS}")
        hf_syms = sorted(s for g in parse_axes(self.hf_axes) for s in g)
        jax_groups = parse_axes(self.jax_axes)
        if self.per_expert:
            if not jax_groups or jax_groups[0] != ("E",):
                raise MappingError(
                    f"rule {self.jax}: an {{expert}} rule's jax_axes must start with 'E' "
                    f"(the stacked experts), got {self.jax_axes!r}"
                )
            jax_groups = jax_groups[1:]
        jax_syms = sorted(s for g in jax_groups for s in g)
        if hf_syms != jax_syms:
            raise MappingError(
                f"rule {self.jax}: hf_axes {self.hf_axes!r} and jax_axes {self.jax_axes!r} "
                "must name the same symbols"
            )

    @property
    def per_expert(self) -> bool:
        """True when the HF name holds `{expert}`: one HF tensor per expert."""
        return "{expert}" in self.hf

    @property
    def shard_kind(self) -> ShardKind:
        """How the engine's tensor parallelism splits the HF tensor (`mappings.shards`):
        `replicated` without a `tp_dim`, `row` for dim 1, and for dim 0 `kv` (the fused "k" /
        "v" shards: split by KV head, replicated past the head count), `vocab` (an HF layout
        that starts with the vocab axis "V": padded vocab-parallel) or `column`.

        Raises:
            MappingError: a `tp_dim` other than 0, 1 or None.
        """
        if self.tp_dim is None:
            return "replicated"
        if self.tp_dim == 1:
            return "row"
        if self.tp_dim != 0:
            raise MappingError(f"rule {self.jax}: tp_dim must be 0, 1 or None, got {self.tp_dim}")
        if self.fused is not None and self.fused[1] in ("k", "v"):
            return "kv"
        if parse_axes(self.hf_axes)[0] == ("V",):
            return "vocab"
        return "column"


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's mapping: its rules and the tied-embedding rule.

    Attributes:
        name: family name, as `ModelConfig.family`.
        rules: the tensors, in checkpoint order.
        tied: None follows the checkpoint's `tie_word_embeddings`; True/False forces it
            (a mapping that forces the wrong value is caught by the checker).
        tied_head: the HF name of the LM head that tied checkpoints omit.
        model_types: the HF config.json `model_type` values this family reads (empty: just
            `name`); `mappings.registry.model_types` gathers them, so a checkpoint's
            `model_type` selects its family.
    """

    name: str
    rules: tuple[Rule, ...]
    tied: bool | None = None
    tied_head: str = "lm_head.weight"
    model_types: tuple[str, ...] = ()

    def is_tied(self, cfg: Any) -> bool:
        """Whether the LM head is the embedding, for a config with `tie_word_embeddings`."""
        return bool(cfg.tie_word_embeddings) if self.tied is None else self.tied


def condition_holds(when: str | None, cfg: Any, family: Family) -> bool:
    """Evaluates a rule's `when` on a ModelConfig."""
    if when is None:
        return True
    if when == "untied":
        return not family.is_tied(cfg)
    return bool(getattr(cfg, when))


@dataclasses.dataclass(frozen=True)
class ConcreteRule:
    """A rule with its layer filled in and its shapes resolved against a config."""

    rule: Rule
    jax: str
    hf: str
    hf_shape: tuple[int, ...]
    jax_shape: tuple[int, ...]
    fused: tuple[str, str] | None
    layer: int | None
    expert: int | None = None

    @property
    def key(self) -> str:
        """The JAX path, with `[e]` for one expert's slice of a stacked param."""
        return self.jax if self.expert is None else f"{self.jax}[{self.expert}]"

    def expert_slice(self) -> ConcreteRule:
        """For a per-expert rule: the rule of this expert's slice alone (JAX layout without
        the leading "E"), which `mappings.transform` applies to one HF tensor."""
        if self.expert is None:
            return self
        rest = " ".join(
            "(" + " ".join(g) + ")" if len(g) > 1 else g[0]
            for g in parse_axes(self.rule.jax_axes)[1:]
        )
        rule = dataclasses.replace(self.rule, hf=self.hf, jax_axes=rest)
        return dataclasses.replace(self, rule=rule, jax_shape=self.jax_shape[1:], expert=None)


def expand(
    family: Family, cfg: Any, jax_dims: Mapping[str, int] | None = None
) -> list[ConcreteRule]:
    """Every concrete tensor of `family` for config `cfg` (a ModelConfig), layer by layer.

    Order: the rules without a layer that come before the first per-layer rule (the
    embedding), then every tensor of layer 0 in rule order, of layer 1, ..., then the
    remaining rules without a layer (final norm, LM head). Sending a version in this order
    lets vLLM's layerwise reload finish (and free) each layer as soon as its last tensor
    arrives, instead of buffering every layer until the last rule.

    Args:
        family: the mapping.
        cfg: provides `dims()`, `num_layers` and the condition attributes.
        jax_dims: sizes on the JAX side where they differ (a padded "V"); defaults to cfg's.

    Raises:
        MappingError: two rules that produce the same JAX path or HF name (named).
    """
    hf_dims = cfg.dims()
    jdims = dict(hf_dims, **(jax_dims or {}))
    out: list[ConcreteRule] = []
    for rule in family.rules:
        if not condition_holds(rule.when, cfg, family):
            continue
        layers: list[int | None] = list(range(cfg.num_layers)) if "{layer}" in rule.jax else [None]
        experts: list[int | None] = list(range(hf_dims["E"])) if rule.per_expert else [None]
        for layer in layers:
            for expert in experts:
                fmt = {"layer": layer, "expert": expert}
                fused = (rule.fused[0].format(**fmt), rule.fused[1]) if rule.fused else None
                out.append(
                    ConcreteRule(
                        rule=rule,
                        jax=rule.jax.format(**fmt),
                        hf=rule.hf.format(**fmt),
                        hf_shape=shape_of(rule.hf_axes, hf_dims),
                        jax_shape=shape_of(rule.jax_axes, jdims),
                        fused=fused,
                        layer=layer,
                        expert=expert,
                    )
                )
    first_layered = next((i for i, r in enumerate(out) if r.layer is not None), len(out))

    def order(item: tuple[int, ConcreteRule]) -> tuple[int, int, int]:
        i, r = item
        if r.layer is not None:
            return (1, r.layer, i)
        return (0 if i < first_layered else 2, 0, i)

    out = [r for _, r in sorted(enumerate(out), key=order)]
    for attr in ("key", "hf"):
        seen: dict[str, int] = {}
        for r in out:
            seen[getattr(r, attr)] = seen.get(getattr(r, attr), 0) + 1
        doubles = sorted(k for k, n in seen.items() if n > 1)
        if doubles:
            side = "jax" if attr == "key" else attr
            raise MappingError(f"{family.name}: {side} names mapped more than once: {doubles}")
    return out
