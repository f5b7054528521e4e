"""`RLBatch`: rollout groups as padded arrays, built on the host, then sharded onto the mesh.

Legend: B rows (one per completion, groups kept together in order), L the padded length (a
bucket), P a row's prompt length, C its completion length, S = P + C its sequence length.

Layout of a row (right padded with `pad_id`):

    tokens[b, :S]  = prompt + completion          (the model's input, positions 0..L-1)
    targets[b, t]  = tokens[b, t + 1] for t < S - 1 (the token that position t predicts)
    loss_mask[b, t] = 1 for P - 1 <= t <= S - 2   (positions whose target is a completion token),
                      except t = P - 1 + j for each forced completion token j (a token the
                      engine wrote without sampling it, e.g. an end-of-think phrase)
    sampler_logprobs[b, P - 1 + j] = the engine's log-prob of completion token j
    token_versions[b, P - 1 + j]   = the weight version that sampled completion token j
                                     (NO_VERSION = -1 at prompt and pad positions)
    routes[b, t]                   = the experts the engine's MoE layers chose in its pass
                                     over tokens[b, t], t < S - 1 ([layers, k]: prompt
                                     positions too, whose keys and values the completion
                                     attends to; NO_ROUTE = -1 at S - 1, padding and rows
                                     without routes)

so ``fused_target_logprobs(model.hidden(tokens, positions), W, targets)`` is aligned with
`sampler_logprobs` and `loss_mask` position by position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.sharding import DATA_AXES, place
from trainer.filters import group_lag
from trainer.losses.advantages import group_advantages
from trainer.losses.base import LossInputs
from trainer.rollouts import RolloutGroup

if TYPE_CHECKING:
    from gateway.messages import Completion

BATCH_AXES: tuple[str, ...] = tuple(DATA_AXES)  # ("dp", "fsdp", "ep"), from models.sharding
NO_VERSION = -1
"""`RLBatch.token_versions` at positions whose target is no completion token (prompt, pad)."""
NO_ROUTE = -1
"""`RLBatch.routes` where the engine sent no route (last token, pad, a row without routes)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RLBatch:
    """A training batch (numpy on the host; jax.Array once sharded by `shard_batch`).

    Attributes:
      tokens: [B, L] int32 input tokens, right padded.
      positions: [B, L] int32, arange(L) on every row.
      targets: [B, L] int32 next tokens (pad where there is none).
      sampler_logprobs: [B, L] float32 sampler log-probs of `targets` (0 outside the mask).
      loss_mask: [B, L] float32, 1 where `targets` is a completion token the engine sampled
        (0 at forced tokens, padding and the prompt).
      prompt_lens: [B] int32 P.
      seq_lens: [B] int32 S = P + C.
      rewards: [B] float32.
      group_mean: [B] float32 mean reward of the row's group.
      group_std: [B] float32 population std of the row's group rewards.
      advantages: [B] float32 group-relative advantages (see `trainer.losses.advantages`).
      group_index: [B] int32 index of the row's group in the input list.
      version_start: [B] int32 weight version at which each completion started (its oldest
        token's version: the row's minimum of `token_versions` over the completion).
      lag: [B] int32 lag of the row's group at the step: the trainer's version minus the
        version of the group's oldest token (its oldest version_start,
        `trainer.filters.group_lag`), for the gap metrics and the corrections that treat stale
        rows apart.
      token_versions: [B, L] int32, aligned with `sampler_logprobs`: the weight version that
        sampled the target at each loss position (from the completion's version spans; an
        update in flight gives one row two or more versions), `NO_VERSION` (-1) at prompt and
        pad positions. Forced tokens carry the version current when they were written.
      routes: [B, L, layers, k] int32 or None: the engine's routed experts (routing replay)
        of its pass over each input token (prompt and completion; at a loss position the
        pass that sampled the target), `NO_ROUTE` (-1) where there is none; None when no
        completion carries routes.
    """

    tokens: np.ndarray | jax.Array
    positions: np.ndarray | jax.Array
    targets: np.ndarray | jax.Array
    sampler_logprobs: np.ndarray | jax.Array
    loss_mask: np.ndarray | jax.Array
    prompt_lens: np.ndarray | jax.Array
    seq_lens: np.ndarray | jax.Array
    rewards: np.ndarray | jax.Array
    group_mean: np.ndarray | jax.Array
    group_std: np.ndarray | jax.Array
    advantages: np.ndarray | jax.Array
    group_index: np.ndarray | jax.Array
    version_start: np.ndarray | jax.Array
    lag: np.ndarray | jax.Array
    token_versions: np.ndarray | jax.Array
    routes: np.ndarray | jax.Array | None = None

    @property
    def num_rows(self) -> int:
        """B."""
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        """L, the padded length."""
        return int(self.tokens.shape[1])

    def metrics(self) -> dict[str, float]:
        """Host-side batch statistics for the logger: ``reward_mean``, ``reward_std``
        (population), ``reward_min``, ``reward_max``, ``reward_count`` (completions: B),
        ``completion_tokens`` (loss-mask total), ``completion_len_mean``,
        ``seq_len_max`` and ``padding_fraction`` (share of the B * L slots past each row's S).
        """
        rewards = np.asarray(self.rewards, np.float64)
        seq_lens = np.asarray(self.seq_lens)
        completion = np.asarray(self.loss_mask).sum(axis=1)
        return {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "reward_min": float(rewards.min()),
            "reward_max": float(rewards.max()),
            "reward_count": float(rewards.size),
            "completion_tokens": float(completion.sum()),
            "completion_len_mean": float(completion.mean()),
            "seq_len_max": float(seq_lens.max()),
            "padding_fraction": float(1.0 - seq_lens.sum() / (self.num_rows * self.length)),
        }

    def loss_inputs(
        self,
        logprobs: jax.Array,
        *,
        ref_logprobs: jax.Array | None = None,
        normalizer: jax.Array | None = None,
    ) -> LossInputs:
        """`LossInputs` for the losses: `logprobs` [B, L] are the current log-probs of `targets`
        (e.g. ``fused_target_logprobs(hidden, w, batch.targets)``), `ref_logprobs` [B, L] those
        of a reference model."""
        return LossInputs(
            logprobs=logprobs,
            sampler_logprobs=jnp.asarray(self.sampler_logprobs),
            advantages=jnp.asarray(self.advantages),
            mask=jnp.asarray(self.loss_mask),
            ref_logprobs=ref_logprobs,
            normalizer=normalizer,
            lag=jnp.asarray(self.lag),
        )


def bucket_length(needed: int, buckets: Sequence[int] | None = None, min_length: int = 8) -> int:
    """The smallest bucket >= `needed`.

    Args:
      needed: the longest sequence S of the batch.
      buckets: allowed lengths (any order); None means powers of two from `min_length` up.
      min_length: the smallest power-of-two bucket when `buckets` is None.

    Raises:
      ValueError: if `needed` exceeds every bucket, or is < 1.
    """
    if needed < 1:
        raise ValueError(f"needed length must be >= 1; got {needed}")
    if buckets is None:
        length = max(min_length, 1)
        while length < needed:
            length *= 2
        return length
    fitting = [b for b in sorted(buckets) if b >= needed]
    if not fitting:
        raise ValueError(f"sequence length {needed} exceeds the largest bucket {max(buckets)}")
    return fitting[0]


def build_rl_batch(
    groups: Sequence[RolloutGroup],
    *,
    pad_id: int = 0,
    normalize_std: bool = True,
    eps: float = 1e-6,
    buckets: Sequence[int] | None = None,
    version: int | None = None,
) -> RLBatch:
    """Pad scored rollout groups into an `RLBatch` with numpy (host side).

    Args:
      groups: scored groups (every completion has a reward); rows keep their order.
      pad_id: the token id written in padding, a valid id in [0, V) since padding still goes
        through the embedding lookup (never counted by the loss).
      normalize_std: GRPO advantages (divide by the group std + eps) or, if False, Dr. GRPO's.
      eps: see `group_advantages`.
      buckets: allowed padded lengths L (see `bucket_length`).
      version: the trainer's weight version at the step, for `RLBatch.lag`; None takes the
        newest ``version_start`` of the groups (the freshest group counts as lag 0).

    Raises:
      ValueError: for no groups, a negative pad_id, an unscored completion, a sequence
        longer than every bucket, a group started after `version`, or completions whose
        routes differ in layers or k.
    """
    if not groups:
        raise ValueError("build_rl_batch needs at least one group")
    if pad_id < 0:
        raise ValueError(f"pad_id must be a token id >= 0; got {pad_id}")
    rows = [(g, c) for g in groups for c in g.completions]
    seq_lens = np.array([len(g.prompt_ids) + len(c.token_ids) for g, c in rows], np.int32)
    length = bucket_length(int(seq_lens.max()), buckets)
    b = len(rows)
    tokens = np.full((b, length), pad_id, np.int32)
    targets = np.full((b, length), pad_id, np.int32)
    sampler = np.zeros((b, length), np.float32)
    mask = np.zeros((b, length), np.float32)
    versions = np.full((b, length), NO_VERSION, np.int32)
    prompt_lens = np.zeros(b, np.int32)
    for i, (group, comp) in enumerate(rows):
        p, s = len(group.prompt_ids), int(seq_lens[i])
        tokens[i, :p] = group.prompt_ids
        tokens[i, p:s] = comp.token_ids
        targets[i, : s - 1] = tokens[i, 1:s]
        sampler[i, p - 1 : s - 1] = comp.logprobs
        mask[i, p - 1 : s - 1] = 1.0
        versions[i, p - 1 : s - 1] = comp.token_versions()
        for j in comp.forced_positions:
            mask[i, p - 1 + j] = 0.0
        prompt_lens[i] = p
    routes = _routes(rows, seq_lens, length)
    current = max(g.version_start for g in groups) if version is None else int(version)
    lags = [group_lag(g, current) for g in groups]
    stats = [
        group_advantages(np.array([g.rewards]), normalize_std=normalize_std, eps=eps)
        for g in groups
    ]
    return RLBatch(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),
        targets=targets,
        sampler_logprobs=sampler,
        loss_mask=mask,
        prompt_lens=prompt_lens,
        seq_lens=seq_lens,
        rewards=np.array([r for g in groups for r in g.rewards], np.float32),
        group_mean=np.concatenate([s.mean[0] for s in stats]),
        group_std=np.concatenate([s.std[0] for s in stats]),
        advantages=np.concatenate([s.advantages[0] for s in stats]),
        group_index=np.array([gi for gi, g in enumerate(groups) for _ in g.completions], np.int32),
        version_start=np.array([c.version_start for _, c in rows], np.int32),
        lag=np.array(
            [lag for lag, g in zip(lags, groups, strict=True) for _ in g.completions], np.int32
        ),
        token_versions=versions,
        routes=routes,
    )


def _routes(rows: Sequence[tuple[RolloutGroup, Completion]], seq_lens: np.ndarray, length: int):
    """[B, L, layers, k] int32 routes of the rows' completions over their first S - 1 tokens
    (`NO_ROUTE` elsewhere), or None when no completion has routes."""
    shapes = {c.routed_experts.shape[1:] for _, c in rows if c.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"completions carry routes of different [layers, k]: {sorted(shapes)}")
    (shape,) = shapes
    routes = np.full((len(rows), length, *shape), NO_ROUTE, np.int32)
    for i, (_, comp) in enumerate(rows):
        if comp.routed_experts is not None:
            routes[i, : int(seq_lens[i]) - 1] = comp.routed_experts  # [S - 1, layers, k]
    return routes


TOKEN_LAG_BINS = ("lag0", "lag1", "lag2plus")
"""The per-token lag bins of `tokens_per_lag`: 0, 1 and >= 2 versions behind."""


def tokens_per_lag(batch: RLBatch, version: int) -> dict[str, float]:
    """Loss-counted tokens by their own lag: ``tokens_lag0``, ``tokens_lag1`` and
    ``tokens_lag2plus`` (float counts), where a token's lag is `version` (the trainer's weight
    version at the step) minus the version that sampled it (`RLBatch.token_versions`); a
    request that spanned an update puts its tokens in more than one bin.

    Raises:
      ValueError: a counted token was sampled by a version newer than `version`.
    """
    versions = np.asarray(batch.token_versions)
    counted = np.asarray(batch.loss_mask) > 0
    lag = version - versions[counted]
    if lag.size and lag.min() < 0:
        raise ValueError(
            f"a token was sampled at version {int(versions[counted].max())}, newer than the "
            f"trainer's version {version}"
        )
    counts = (lag == 0).sum(), (lag == 1).sum(), (lag >= 2).sum()
    return {f"tokens_{name}": float(n) for name, n in zip(TOKEN_LAG_BINS, counts, strict=True)}


def batch_sharding(mesh: Mesh, ndim: int, axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
    """Sharding of a [B, ...] array along B over the `axes` present in `mesh` (others ignored)."""
    present = tuple(a for a in axes if a in mesh.axis_names)
    if ndim == 0 or not present:
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(present, *([None] * (ndim - 1))))


def shard_batch(batch: RLBatch, mesh: Mesh, axes: Sequence[str] = BATCH_AXES) -> RLBatch:
    """Put every array of `batch` on `mesh`, split along B over ``('dp', 'fsdp', 'ep')``.

    Other mesh axes (e.g. 'cp', 'tp') hold replicas. With several processes, every process
    passes the same whole batch (`trainer.global_batch.share_batch`) and puts only the rows its
    own devices hold (`models.sharding.place`), so the global array equals the single-process
    one.

    Raises:
      ValueError: if B is not divisible by the product of those axes' sizes.
    """
    present = [a for a in axes if a in mesh.axis_names]
    shards = int(np.prod([mesh.shape[a] for a in present])) if present else 1
    if batch.num_rows % shards:
        raise ValueError(
            f"batch rows {batch.num_rows} must be divisible by the {shards} batch shards "
            f"of mesh axes {tuple(present)} {dict(mesh.shape)}"
        )

    def put(x: np.ndarray) -> jax.Array:
        sharding = batch_sharding(mesh, np.ndim(x), axes)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return place(np.asarray(x), sharding)

    return jax.tree.map(put, batch)
