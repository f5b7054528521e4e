"""The jitted RL train step on a ("dp", "fsdp", "ep", "tp") mesh, with gradient accumulation.

Legend: B rows of the batch, L padded length, D model width, V vocabulary, k micro-batches,
M = B / k rows per micro-batch.

One call: shard the host `RLBatch` along B over ("dp", "fsdp"); split it into k micro-batches
(strided rows: micro-batch j holds rows {i * k + j}, so every device keeps its share of every
micro-batch and the split needs no communication, as in the seed write-up "Async RL in Pure JAX",
section "Shardings"); for each, `model.hidden` -> fused log-probs of the targets at the sampling
temperature -> the registry's loss with the full batch's normalizer (so the k micro-losses sum to
the full-batch loss and the update does not depend on k); sum the gradients; one optax update.
Params live as a flat dict by dot path (`models.params.flat_params`), placed by their declared
logical axes (`models.sharding.param_sharding`: embed over "fsdp", heads / kv_heads / mlp /
vocab over "tp", Megatron-style); the optimizer moments get the same placement, and the step
runs under `jax.set_mesh` so the decoder's activation constraints (`models.axes.constrain`)
apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.decoder import Decoder
from models.params import flat_params, param_axes, path_str
from models.scan import remat_policy
from models.sharding import check_ep, check_tp, host_value, param_sharding, put
from trainer.batch import BATCH_AXES, RLBatch, shard_batch
from trainer.gap import GAP_SETS, gap_metrics
from trainer.global_batch import share_batch
from trainer.logprobs import fused_target_logprobs
from trainer.losses.base import PolicyLoss
from trainer.losses.corrections import CORRECTION_METRICS
from trainer.moe_aux import check_moe_aux, moe_aux_loss
from trainer.replay import ROUTE_SUMS, check_routing_replay, hidden_with_routes

Params = dict[str, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step updates.

    Attributes:
      params: flat params by dot path ("layers.0.attn.q.kernel") -> jax.Array, sharded by
        their logical axes.
      opt_state: the optax state of those params (moments sharded like them).
      step: [] int32 jax.Array, updates applied so far.
    The same structure holds NamedShardings (`TrainStep.shardings`) or ShapeDtypeStructs
    (`TrainStep.abstract_state`).
    """

    params: Any
    opt_state: Any
    step: Any


class ModelTemplate:
    """Rebuilds a `Decoder` from flat params (inside or outside jit) without re-initialising.

    Args:
      model: a Decoder whose only variables are `nnx.Param`s.

    Raises:
      ValueError: if the model holds non-Param state (it would be lost by the step).
    """

    def __init__(self, model: Decoder):
        self.cfg = model.cfg
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        if jax.tree.leaves(rest):
            raise ValueError("the train step handles models whose only variables are nnx.Param")
        self.graphdef = graphdef
        self._flat = [
            (path, var.replace(jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype)))
            for path, var in nnx.to_flat_state(params)
        ]

    def merge(self, params: Params) -> Decoder:
        """A Decoder viewing `params` (no copy).

        Raises:
          KeyError: for a missing param path.
        """
        filled = [(path, var.replace(params[path_str(path)])) for path, var in self._flat]
        return nnx.merge(self.graphdef, nnx.from_flat_state(filled))


def full_batch_normalizer(loss: PolicyLoss, mask: jax.Array) -> jax.Array:
    """The denominator of `loss`'s aggregation over the whole batch, mask [B, L] -> [] float32.

    token_mean: masked tokens; seq_mean_token_mean: rows with at least one masked token;
    seq_sum_constant: B * max_tokens (default L). Passed as `LossInputs.normalizer` to every
    micro-batch so their losses sum to the full-batch loss (see trainer.losses.base).
    """
    mask = mask.astype(jnp.float32)
    if loss.aggregation == "token_mean":
        return jnp.maximum(jnp.sum(mask), 1.0)
    if loss.aggregation == "seq_mean_token_mean":
        return jnp.maximum(jnp.sum(jnp.sum(mask, axis=1) > 0), 1).astype(jnp.float32)
    length = mask.shape[1] if loss.max_tokens is None else loss.max_tokens
    return jnp.asarray(mask.shape[0] * length, jnp.float32)


class TrainStep:
    """The compiled train step of one model, loss, optimizer and mesh.

    Args:
      model: the policy (its structure and config; its params are taken by `init_state`).
      loss: a loss from `trainer.losses.make_loss`.
      tx: the optax transformation (build it with ``grad_accum_steps=1``: accumulation happens
        here, inside one call).
      mesh: a ("dp", "fsdp", "ep", "tp") mesh (`models.sharding.make_mesh`).
      temperature: the engines' sampling temperature (> 0); log-probs are computed under it.
      top_k, top_p: the engines' sampling truncation (0 and 1: off); log-probs are taken under
        the truncated, renormalised distribution (`trainer.truncation`).
      micro_batches: k >= 1; B must be divisible by k * dp * fsdp.
      chunk_size: rows per chunk of the fused log-prob kernel.
      attention_block: tokens per block of the attention when the padded length L exceeds
        it (`models.blockwise`: memory O(L · block)); 0 keeps the dense path.
      min_shard_bytes: params below this size (bytes) are replicated.
      scan_layers: run the layers as one `jax.lax.scan` over their stacked params
        (`models.scan`); False: a Python loop over the layers. Same values either way.
      remat: the per-layer remat policy, a `models.scan.REMAT_POLICIES` name ("none": keep
        every activation for the backward pass).
      routing_replay: a batch's MoE routes (`RLBatch.routes`) route the forward's tokens as
        the engine did (`trainer.replay`); False: the trainer's own routers. A batch with
        routes reports ``routing_agreement`` either way.
      moe_aux_coef: weight of the load-balancing loss of a mixture-of-experts model
        (`trainer.moe_aux`); 0 (default): off, the routers are not recorded.
      trainable: which params train, by dot path (e.g. `models.lora.is_adapter` for LoRA);
        None (default): all. The others are frozen: no gradient is computed for them (the
        backward pass still runs through them to reach the trainable ones), `tx` and its
        state cover the trainable params only, and ``grad_norm`` is theirs.

    Precision: the params (master weights) and the optimizer state keep the model's
    ``param_dtype``; the forward casts each weight to ``cfg.dtype`` where it is used, so
    ``dtype="bfloat16", param_dtype="float32"`` is bf16 mixed precision with fp32 master
    weights and fp32 Adam moments (optax follows the params' dtype), and the gradients reach
    the master weights in fp32. The LM head, the log-softmax and the gathered token log-probs
    are always float32 (`trainer.logprobs`: the hidden states and the head are cast up), as are
    the loss and its reductions.

    A loss with ``kl_coef > 0`` needs a frozen reference policy: call `set_reference` first.

    Raises:
      MeshError: the mesh's "tp" does not divide the model's heads or KV heads, or its "ep"
        is above 1 on a dense model or does not divide num_experts.
      ValueError: a bad setting above (named), a param dim its mesh axes do not split, or a
        `trainable` that selects no param.
    """

    def __init__(
        self,
        model: Decoder,
        loss: PolicyLoss,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        micro_batches: int = 1,
        chunk_size: int = 1024,
        min_shard_bytes: int = 1 << 16,
        attention_block: int = 0,
        scan_layers: bool = False,
        remat: str = "none",
        routing_replay: bool = False,
        moe_aux_coef: float = 0.0,
        trainable: Callable[[str], bool] | None = None,
    ):
        remat_policy(remat)  # raises on an unknown name
        check_routing_replay(model.cfg, routing_replay)
        check_moe_aux(model.cfg, moe_aux_coef)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0; got {temperature}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1; got {micro_batches}")
        if attention_block < 0:
            raise ValueError(f"attention_block must be >= 0 tokens; got {attention_block}")
        if top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1; got {top_k}, {top_p}")
        check_tp(model.cfg, mesh.shape.get("tp", 1))
        check_ep(model.cfg, mesh.shape.get("ep", 1))
        self.template = ModelTemplate(model)
        self.loss = loss
        self.tx = tx
        self.mesh = mesh
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.micro_batches = int(micro_batches)
        self.chunk_size = int(chunk_size)
        self.attention_block = int(attention_block)
        self.min_shard_bytes = int(min_shard_bytes)
        self.scan_layers = bool(scan_layers)
        self.remat = remat
        self.routing_replay = bool(routing_replay)
        self.moe_aux_coef = float(moe_aux_coef)
        self._abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat_params(model).items()
        }
        self._trained = [k for k in self._abstract if trainable is None or trainable(k)]
        if not self._trained:
            raise ValueError(
                f"trainable selects none of the model's {len(self._abstract)} params (a LoRA "
                "run whose model holds no adapter?): nothing would train"
            )
        self._replicated = NamedSharding(mesh, P())
        axes = param_axes(model)
        self._param_shardings = {
            k: param_sharding(axes[k] or (), v.shape, v.dtype, mesh, self.min_shard_bytes)
            for k, v in self._abstract.items()
        }
        self._opt_shardings = jax.tree_util.tree_map_with_path(
            self._place_moment, jax.eval_shape(tx.init, self.trained(self._abstract))
        )
        self.shardings = TrainState(self._param_shardings, self._opt_shardings, self._replicated)
        self.ref_params: Params | None = None
        self._jitted = jax.jit(
            self._step, out_shardings=(self.shardings, self._replicated), donate_argnums=0
        )

    def _place_moment(self, path: tuple, leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        """An optimizer-state leaf is placed like the param whose dot path keys it (a moment of
        the param's shape); anything else (step counts) is replicated."""
        for entry in reversed(path):
            name = getattr(entry, "key", None)
            if name in self._param_shardings and leaf.shape == self._abstract[name].shape:
                return self._param_shardings[name]
        return self._replicated

    def trained(self, params: dict[str, Any]) -> dict[str, Any]:
        """The trainable entries of a flat param dict (dot path -> array): what the gradients,
        `tx` and its state cover (``tx.init`` takes this)."""
        return {k: params[k] for k in self._trained}

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state (a restore target for orbax)."""
        params = {
            k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._param_shardings[k])
            for k, s in self._abstract.items()
        }
        opt = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.eval_shape(self.tx.init, self.trained(params)),
            self._opt_shardings,
        )
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
        return TrainState(params, opt, step)

    def init_state(self, model: Decoder, step: int = 0) -> TrainState:
        """Copies of `model`'s params placed on the mesh (the model stays valid: steps donate
        the state, never the model's arrays) and a fresh optimizer state there."""
        params = {k: put(v, self._param_shardings[k]) for k, v in flat_params(model).items()}
        init = jax.jit(self.tx.init, out_shardings=self._opt_shardings)
        opt_state = init(self.trained(params))
        return TrainState(params, opt_state, jax.device_put(jnp.int32(step), self._replicated))

    def set_reference(self, model: Decoder) -> None:
        """Keep a frozen copy of `model`'s params (placed like the policy's) as the reference of
        the loss's KL term (e.g. the initial checkpoint)."""
        flat = flat_params(model)
        self.ref_params = {k: put(v, self._param_shardings[k]) for k, v in flat.items()}

    def model(self, state: TrainState) -> Decoder:
        """The Decoder viewing `state.params` (for publishing weights or evaluation); valid
        until the next step, which donates the state's buffers."""
        return self.template.merge(state.params)

    def __call__(
        self, state: TrainState, batch: RLBatch | None
    ) -> tuple[TrainState, dict[str, float]]:
        """One update on `batch` (host numpy, see `trainer.batch.build_rl_batch`).

        With several processes (`trainer.distributed`) every process calls it at the same
        step; process 0 passes the batch, the others None (`trainer.global_batch.share_batch`
        broadcasts it), and every process gets the same state and metrics.

        `state` is donated: use the returned one. Returns the new state and host floats:
        ``loss``, ``pg_loss``, ``kl``, ``grad_norm`` (before clipping), ``clip_fraction``,
        ``ratio_mean`` and ``sampler_kl`` (the k3 estimate of KL(pi_sampler || pi_theta) over
        masked tokens, the engine-trainer gap; both token-weighted over micro-batches),
        ``num_tokens`` (masked tokens), with a correction its ``correction/...`` token sums
        (`trainer.losses.corrections`), and the gap statistics ``gap/{all,lag0,lag1plus}/...``
        of `trainer.gap.gap_metrics` over the whole batch (a set with no token is left out);
        for a batch with MoE routes, ``routing_agreement`` (the share of loss-token x layer
        pairs whose engine expert set equals the trainer's own, `trainer.replay`) and its sums
        ``routing/agree``, ``routing/pairs``.

        Raises:
          ValueError: if B is not divisible by micro_batches * dp * fsdp, or the loss has a KL
            term and no reference was set.
        """
        if self.loss.kl_coef > 0 and self.ref_params is None:
            raise ValueError(
                f"loss {self.loss.name} has kl_coef={self.loss.kl_coef}: call set_reference first"
            )
        batch = share_batch(batch)
        shards = int(np.prod([self.mesh.shape[a] for a in BATCH_AXES if a in self.mesh.shape]))
        if batch.num_rows % (self.micro_batches * shards):
            raise ValueError(
                f"batch rows {batch.num_rows} must be divisible by micro_batches "
                f"{self.micro_batches} x batch shards {shards}"
            )
        ref = self.ref_params if self.loss.kl_coef > 0 else None
        with jax.set_mesh(self.mesh):
            new_state, metrics = self._jitted(state, shard_batch(batch, self.mesh), ref)
        host = {k: float(host_value(v)) for k, v in metrics.items()}
        for name in GAP_SETS:
            if host[f"gap/{name}/tokens"] == 0:
                host = {k: v for k, v in host.items() if not k.startswith(f"gap/{name}/")}
        return new_state, host

    def lower(self, batch: RLBatch) -> Any:
        """The step lowered for `batch`'s shapes against `abstract_state()` (no state is
        allocated): ``.compile()`` gives the executable, called as
        ``compiled(state, shard_batch(batch, mesh), None)`` -> (new state, metrics arrays), and
        its ``memory_analysis()`` XLA's planned bytes. A KL loss is lowered without its
        reference term. For benchmarks of compile time and memory."""
        sharded = shard_batch(batch, self.mesh)
        return self._jitted.lower(self.abstract_state(), sharded, None)

    def _logprobs(self, params: Params, mb: RLBatch) -> jax.Array:
        """[M, L] float32 log-probs of the micro-batch's targets at the sampling temperature."""
        return self._forward(params, mb)[0]

    def _forward(
        self, params: Params, mb: RLBatch, aux: bool = False
    ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
        """The forward of the micro-batch: ([M, L] float32 log-probs of the targets at the
        sampling temperature, the routing agreement sums of `trainer.replay` for a micro-batch
        with routes ({} otherwise; its forward replays them when `routing_replay`), [] float32
        load-balancing loss over the loss-mask tokens, `trainer.moe_aux`, 0 unless `aux` and
        moe_aux_coef). The routers are recorded (out of each layer, scanned or not) only
        when either needs them."""
        model = self.template.merge(params)
        tokens, positions = jnp.asarray(mb.tokens), jnp.asarray(mb.positions)
        routing: dict[str, jax.Array] = {}
        aux_loss = jnp.zeros((), jnp.float32)
        with_aux = aux and self.moe_aux_coef > 0
        if mb.routes is not None or with_aux:  # the routers recorded: replay, agreement, aux
            mask = jnp.asarray(mb.loss_mask)
            routes = None if mb.routes is None else jnp.asarray(mb.routes)
            hidden, routing, record = hidden_with_routes(
                model, tokens, positions, routes, mask,
                replay=self.routing_replay, attention_block=self.attention_block,
                scan_layers=self.scan_layers, remat=self.remat,
            )  # fmt: skip
            if with_aux:
                aux_loss = moe_aux_loss(model.cfg, record.router_logits, mask)
        else:
            hidden, _ = model.hidden(
                tokens,
                positions,
                attention_block=self.attention_block,
                scan_layers=self.scan_layers,
                remat=self.remat,
            )  # [M, L, D] float32 (the residual stream, models.layers.project); log-probs float32
        logp = fused_target_logprobs(
            hidden,
            model.lm_head_weight(),
            jnp.asarray(mb.targets),
            temperature=self.temperature,
            softcap=self.template.cfg.final_logit_softcap,
            chunk_size=self.chunk_size,
            top_k=self.top_k,
            top_p=self.top_p,
        )
        return logp, routing, aux_loss

    def _loss(
        self, params: Params, mb: RLBatch, normalizer: jax.Array, ref: Params | None, total: Any
    ):
        """The micro-batch's loss: the policy loss, plus with moe_aux_coef its load-balancing
        loss weighted by its share of the batch's `total` loss-mask tokens (so the k shares sum
        to the token-weighted mean over micro-batches, the whole batch's at k = 1)."""
        logp, routing, aux = self._forward(params, mb, aux=True)
        ref_logp = None if ref is None else jax.lax.stop_gradient(self._logprobs(ref, mb))
        out = self.loss(mb.loss_inputs(logp, ref_logprobs=ref_logp, normalizer=normalizer))
        share = jnp.sum(jnp.asarray(mb.loss_mask, jnp.float32)) / total
        metrics = {**out.metrics, **routing, "moe_aux_loss": aux * share}
        return out.loss + self.moe_aux_coef * aux * share, (metrics, jax.lax.stop_gradient(logp))

    def _split(self, x: jax.Array) -> jax.Array:
        """[B, ...] -> [k, M, ...], micro-batch j holding rows {i * k + j}."""
        k = self.micro_batches
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:])  # [M, k, ...]
        x = jnp.swapaxes(x, 0, 1)  # [k, M, ...]
        spec = P(None, tuple(a for a in BATCH_AXES if a in self.mesh.shape))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _step(self, state: TrainState, batch: RLBatch, ref: Params | None):
        normalizer = full_batch_normalizer(self.loss, jnp.asarray(batch.loss_mask))
        total = jnp.maximum(jnp.sum(jnp.asarray(batch.loss_mask, jnp.float32)), 1.0)
        trained = self.trained(state.params)
        frozen = {k: v for k, v in state.params.items() if k not in trained}
        grad_fn = jax.value_and_grad(
            lambda p, *args: self._loss({**frozen, **p}, *args), has_aux=True
        )  # gradients of the trainable params only
        micro = jax.tree.map(self._split, batch)

        def body(acc, mb):
            grads, totals = acc
            (loss, (m, logp)), g = grad_fn(trained, mb, normalizer, ref, total)
            n = m["num_tokens"]
            grads = jax.tree.map(jnp.add, grads, g)
            totals = {
                "loss": totals["loss"] + loss,
                "pg_loss": totals["pg_loss"] + m["pg_loss"],
                "num_tokens": totals["num_tokens"] + n,
                "clip_fraction": totals["clip_fraction"] + m["clip_fraction"] * n,
                "ratio_mean": totals["ratio_mean"] + m["ratio_mean"] * n,
                "kl": totals["kl"] + m["kl"] * n,
                "sampler_kl": totals["sampler_kl"] + m["sampler_kl"] * n,
                **{k: totals[k] + m[k] for k in extra},
            }
            return (grads, totals), logp

        zeros = jax.tree.map(jnp.zeros_like, trained)
        extra = CORRECTION_METRICS if self.loss.correction is not None else ()
        extra += ROUTE_SUMS if batch.routes is not None else ()
        extra += ("moe_aux_loss",) if self.moe_aux_coef > 0 else ()
        names: tuple[str, ...] = ("loss", "pg_loss", "num_tokens", "clip_fraction", "ratio_mean")
        names += ("kl", "sampler_kl", *extra)
        init = (zeros, {k: jnp.zeros((), jnp.float32) for k in names})
        (grads, totals), logp = jax.lax.scan(body, init, micro)  # logp [k, M, L]
        length = batch.tokens.shape[1]
        gap = gap_metrics(
            logp.reshape(-1, length),
            micro.sampler_logprobs.reshape(-1, length),
            micro.loss_mask.reshape(-1, length),
            micro.lag.reshape(-1),
        )
        tokens = jnp.maximum(totals["num_tokens"], 1.0)
        updates, opt_state = self.tx.update(grads, state.opt_state, trained)
        params = {**state.params, **optax.apply_updates(trained, updates)}
        metrics = {
            "loss": totals["loss"],
            "pg_loss": totals["pg_loss"],
            "kl": totals["kl"] / tokens,
            "grad_norm": optax.tree.norm(grads),
            "clip_fraction": totals["clip_fraction"] / tokens,
            "ratio_mean": totals["ratio_mean"] / tokens,
            "sampler_kl": totals["sampler_kl"] / tokens,
            "num_tokens": totals["num_tokens"],
            **{k: totals[k] for k in extra},
            **gap,
        }
        if batch.routes is not None:
            metrics["routing_agreement"] = totals["routing/agree"] / jnp.maximum(
                totals["routing/pairs"], 1.0
            )
        return TrainState(params, opt_state, state.step + 1), metrics
