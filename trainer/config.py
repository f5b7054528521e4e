"""The run's configuration: pydantic models for the model, trainer, loss, optimizer, rollout and
sync sections, read from YAML with ``section.key=value`` overrides. Imports no ML library, so an
entry point can parse and check its config in well under a second.

Every model forbids unknown keys; `load_config` reports the first bad key or value by its dotted
path (e.g. ``rollout.max_lag: Input should be greater than or equal to 0 (got -1)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from trainer.episodes import EpisodeSetup

LossName = Literal["grpo", "dr_grpo", "dapo", "cispo"]
Aggregation = Literal["seq_mean_token_mean", "token_mean", "seq_sum_constant"]


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, use_attribute_docstrings=True
    )


class ModelSection(_Section):
    """The policy checkpoint."""

    path: str = ""
    """HF safetensors folder (config.json, model.safetensors, tokenizer)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the trainer's forward: the matmul operands (each weight and its input
    cast to it where it is used, accumulated in float32: `models.layers.project`), attention
    and the KV cache; norms and rotary stay float32, the residual stream as `residual_dtype`.
    bfloat16 with `param_dtype` float32 is bf16 mixed precision with fp32 master weights;
    the LM head, log-softmax and token log-probs stay float32 either way (float32 is faster
    than bfloat16 on CPU: `benchmarks/model_scale.py`)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of the trained params (the master weights) and of the optimizer moments."""
    residual_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trainer's residual stream, of each attention and MLP output added to it
    and of the MLP's hidden activation: float32 (as the JAX engine computes), or bfloat16
    with `dtype` bfloat16 (Megatron's `fp32_residual_connection=False`): those activations the
    backward pass keeps are half as wide, which shrinks a step's planned bytes only where they
    dominate (`benchmarks/model_scale.py`, precision `bf16_residual`: 1.0 of the float32
    residual's for Llama-3.2-1B at 256 tokens, 0.97 for SmolLM2-360M at 4,096), at a wider
    sampler-trainer gap (each sublayer output rounded to bf16 before the add)."""
    scan_layers: bool = False
    """Run the trainer's forward over the layers as one `jax.lax.scan` over their params
    stacked inside the step (`models.scan`: one layer body in the program; one transient copy
    of the layer params per step); false: a Python loop over the layers, the default because
    it compiled faster and peaked lower on the CPU measured (`benchmarks/model_scale.py`).
    The JAX engine's cached decode always loops (a KV cache entry per layer)."""
    remat: Literal[
        "none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable"
    ] = "none"
    """Per-layer rematerialisation of the trainer's backward pass (`jax.checkpoint_policies`):
    none keeps every activation; full recomputes each layer's; dots_saveable keeps the matmul
    outputs only."""

    @model_validator(mode="after")
    def _residual_not_narrower(self) -> ModelSection:
        if self.residual_dtype not in ("float32", self.dtype):
            raise ValueError(
                f"residual_dtype={self.residual_dtype!r} needs dtype={self.residual_dtype!r} "
                f"(got dtype={self.dtype!r}): a float32 model keeps a float32 residual"
            )
        return self


class TrainerSection(_Section):
    """The training loop and its mesh."""

    steps: int = Field(default=100, ge=1)
    """Optimizer updates to run (each publishes one new weight version)."""
    prompts_per_step: int = Field(default=8, ge=1)
    """P: prompt groups per update; the batch has P * rollout.group_size rows."""
    micro_batches: int = Field(default=1, ge=1)
    """Gradient accumulation: the batch is split into this many micro-batches per update."""
    dp: int = Field(default=1, ge=1)
    """Data-parallel axis size of the train mesh."""
    fsdp: int = Field(default=-1, ge=-1)
    """FSDP axis size (the model width `embed` of every param is split over it); -1 takes
    every device dp, ep and tp leave."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel axis size of the train mesh (Megatron-style: query heads, KV heads,
    the MLP width and the vocab split over it; `models.axes`); must divide the model's heads
    and KV heads and, with dp, the trainer's devices."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel axis size of the train mesh: the stacked experts of a mixture-of-experts
    model split over it and the batch's rows too (`models.axes`); must divide the model's
    num_experts and, with dp and tp, the trainer's devices; 1 on a dense model."""
    min_shard_bytes: int = Field(default=1 << 16, ge=0)
    """Params smaller than this (bytes) are replicated instead of sharded by their logical
    axes."""
    logprob_chunk_size: int = Field(default=1024, ge=1)
    """Rows per chunk of the fused log-prob kernel."""
    attention_block: int = Field(default=512, ge=0)
    """Tokens per block of the train step's attention: a batch padded longer than this
    attends blockwise (`models.blockwise`, memory O(L · block) instead of O(L²));
    shorter ones take the dense path. 0: always dense. The memory and time against the dense
    path are measured in `benchmarks/attention_memory.py`."""
    seed: int = 0
    """Seed of the trainer's RNG and of the problem order."""
    run_dir: str = "runs/default"
    """Folder of metrics.jsonl and checkpoints/."""
    checkpoint_every: int = Field(default=5, ge=0)
    """Save a checkpoint every this many updates (0: only at the end and at a stop); a rerun
    with the same run_dir resumes from the newest (see resume)."""
    max_checkpoints: int = Field(default=3, ge=1)
    """Checkpoints kept on disk (oldest deleted first)."""
    resume: bool = True
    """Resume from the newest checkpoint in run_dir/checkpoints when there is one."""

    @model_validator(mode="after")
    def _mesh(self) -> TrainerSection:
        if self.fsdp == 0:
            raise ValueError("fsdp must be >= 1 or -1 (all remaining devices); got 0")
        return self


class LossSection(_Section):
    """The policy-gradient loss (a name of the registry in trainer.losses) and its settings."""

    name: LossName = "grpo"
    """grpo, dr_grpo, dapo (clip-higher, token mean) or cispo."""
    eps_low: float | None = Field(default=None, ge=0, lt=1)
    """Lower clip (ratio floor 1 - eps_low); None: the loss's default."""
    eps_high: float | None = Field(default=None, ge=0)
    """Upper clip (ratio ceiling 1 + eps_high); None: the loss's default."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL term to a reference model (0: none, no reference kept)."""
    aggregation: Aggregation | None = None
    """Token aggregation for grpo and cispo; None: the loss's default."""
    moe_aux_coef: float = Field(default=0.0, ge=0)
    """Weight of the load-balancing auxiliary loss of a mixture-of-experts model (Switch
    Transformer's, HF's `router_aux_loss_coef` form; `trainer.moe_aux`) added to the policy
    loss over completion tokens and reported as train/moe_aux_loss; 0: off. Refused on a dense
    model; works with model.scan_layers and model.remat."""
    correction: Literal["none", "tis_token", "tis_sequence", "icepop", "decoupled_ppo"] = "none"
    """Off-policy correction applied to the loss (trainer.losses.corrections): truncated
    importance sampling per token or sequence (Yao et al. 2025), IcePop's masking, or AReaL's
    decoupled PPO for rows of lag >= 1."""
    tis_cap: float = Field(default=2.0, gt=0)
    """C of truncated importance sampling: weights min(pi_trainer / pi_sampler, C)."""
    icepop_beta: float = Field(default=2.0, gt=1)
    """IcePop drops tokens whose pi_trainer / pi_sampler leaves [1 / beta, beta]."""
    decoupled_cap: float | None = Field(default=None, gt=0)
    """Cap of decoupled PPO's behaviour weight pi_prox / pi_sampler; None: uncapped."""
    routing_replay: Literal["off", "engine"] = "off"
    """Mixture-of-experts models: engine makes the train step's forward route each completion
    token to the experts the engine's routers chose when it sampled the token (routing replay,
    `trainer.replay`; the engines are asked for routes), so a router near-tie broken
    differently by the engine and the trainer cannot corrupt the token's importance ratio;
    off: the trainer's own routers. Needs a MoE checkpoint; either engine gives routes (the
    vLLM engines record them with prefix caching off, `rollout_engine.vllm.routes`); works
    with model.scan_layers and model.remat."""

    @model_validator(mode="after")
    def _fixed_aggregation(self) -> LossSection:
        if self.aggregation is not None and self.name in ("dr_grpo", "dapo"):
            raise ValueError(f"loss {self.name} fixes its aggregation; leave aggregation unset")
        return self

    def loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``trainer.losses.make_loss(name, **kwargs)`` (unset ones left
        out so each loss keeps its own defaults)."""
        out: dict[str, Any] = {"kl_coef": self.kl_coef}
        for key in ("eps_low", "eps_high", "aggregation"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class OptimSection(_Section):
    """AdamW with warmup and cosine decay (see trainer.optim.OptimizerConfig)."""

    learning_rate: float = Field(default=1e-6, ge=0)
    """Peak learning rate; 0 keeps the weights fixed (measures the engine-trainer mismatch)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Updates of linear warmup."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay (matrices only)."""
    b1: float = Field(default=0.9, ge=0, lt=1)
    b2: float = Field(default=0.999, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this; None: no clipping."""


class LoraSection(_Section):
    """LoRA adapters (Hu et al. 2021) trained instead of the full weights (`models.lora`)."""

    rank: int = Field(default=0, ge=0)
    """r of every adapter; 0: no LoRA, the full weights are trained."""
    alpha: float = Field(default=16.0, gt=0)
    """Scaling numerator: each projection's update is (alpha / rank) A B (PEFT's lora_alpha)."""
    targets: tuple[
        Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ...
    ] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Projections that get an adapter, by their HF / PEFT names (dense models only)."""
    init_b_std: float = Field(default=0.0, ge=0)
    """0: B starts at zero (PEFT's init: the model starts unchanged); > 0: B drawn from
    N(0, init_b_std²), a non-zero adapter for tests at fixed weights."""


class RolloutSection(_Section):
    """How rollouts are generated and which ones are trained on."""

    backend: Literal["vllm", "jax"] = "vllm"
    """The engine backend."""
    num_engines: int = Field(default=1, ge=1)
    """Engine processes the launcher starts."""
    group_size: int = Field(default=4, ge=1)
    """G: completions per prompt."""
    max_new_tokens: int = Field(default=256, ge=1)
    """Most tokens per completion."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; the trainer's log-probs use the same one."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    """0: no top-k filter."""
    max_lag: int = Field(default=1, ge=0)
    """Groups started more than this many versions before the update are dropped; 0 is the
    synchronous on-policy loop."""
    queue_steps: int | None = Field(default=None, ge=1)
    """Updates' worth of prompts kept submitted ahead; None: max_lag + 1 (the most that can
    still be trained within max_lag)."""
    drop_zero_variance: bool = False
    """Drop groups whose rewards are all equal (DAPO dynamic sampling)."""
    fetch_timeout_s: float = Field(default=1.0, gt=0)
    """Seconds one FetchRollouts call waits."""
    rollout_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds of silence (no group arriving from any engine) after which the trainer's wait
    for an update's rollouts fails; the wait goes on as long as groups keep arriving."""
    sync_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds the trainer waits for engines to load a new version."""
    scoring_workers: int = Field(default=2, ge=1)
    """Threads scoring completions."""
    env: str | None = None
    """A multi-turn environment (`envs.registry`: "calculator", "countdown"): each of the G
    samples is then an episode of model turns and the environment's observations, played by
    the engine (`rollout_engine.episode`), with max_new_tokens the bound of each model turn;
    None: one completion per sample."""
    max_turns: int = Field(default=4, ge=1)
    """Model turns per episode at most (with `env`)."""
    episode_tokens: int | None = Field(default=None, ge=1)
    """Tokens after the prompt per episode at most, model and observation tokens together
    (with `env`); None: max_turns * max_new_tokens."""
    max_observation_chars: int = Field(default=1024, ge=1)
    """An observation is cut to this many characters (with `env`)."""
    return_routes: bool = False
    """Ask the engines for each completion's routed experts (mixture-of-experts models) so
    the train step reports `train/routing_agreement`, the share of token-layer pairs whose
    expert set from the engine equals the trainer's own; loss.routing_replay=engine implies
    it. Same needs as routing replay."""

    @field_validator("env")
    @classmethod
    def _known_env(cls, v: str | None) -> str | None:
        from envs.registry import ENVIRONMENTS

        if v is not None and v not in ENVIRONMENTS:
            raise ValueError(f"expected one of {sorted(ENVIRONMENTS)} or null, got {v!r}")
        return v

    def episodes(self) -> EpisodeSetup | None:
        """The run's `trainer.episodes.EpisodeSetup`, or None without `env`."""
        from trainer.episodes import EpisodeSetup

        if self.env is None:
            return None
        tokens = self.episode_tokens or self.max_turns * self.max_new_tokens
        return EpisodeSetup(self.env, self.max_turns, tokens, self.max_observation_chars)

    def prompts_ahead(self, prompts_per_step: int) -> int:
        """Prompts kept submitted beyond those the current update still needs."""
        steps = self.max_lag + 1 if self.queue_steps is None else self.queue_steps
        return (steps - 1) * prompts_per_step


class SyncSection(_Section):
    """How each new weight version reaches the engines."""

    background: bool = False
    """True: the loop copies each new version to host buffers and trains on while a thread
    pushes the newest copy (versions offered during a push are skipped;
    `trainer.publish.background`), and prompts are leased to engines whose loaded version is
    within rollout.max_lag of the trainer's newest. False: every update waits until every
    engine loaded its version (the synchronous push). False by default: on the smoke job
    (`benchmarks/background_push.py`, max_lag 1) background pushes gave 1.08x the steps/hour
    but 2.7x the groups dropped for lag (prompts leased to engines a version behind), and a
    push there (0.08 s) is a small part of a step (0.2 s)."""
    flush_timeout_s: float = Field(default=600.0, gt=0)
    """With background: seconds the end of a completed run waits for the last version's
    push (the engines then serve the final weights)."""
    lora_only: bool = False
    """With lora.rank > 0: push only the LoRA adapters (PEFT-named A and B, rank, alpha and
    targets in the manifest) to engines started with the same rank and targets, which keep
    their start checkpoint as the base (the JAX engine merges each adapter into it on load,
    vLLM loads it as a new LoRA id per version). False: every push carries the whole model,
    adapters merged (any engine serves it). See docs/lora.md."""


class Config(_Section):
    """A whole run."""

    model: ModelSection = Field(default_factory=ModelSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    loss: LossSection = Field(default_factory=LossSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    sync: SyncSection = Field(default_factory=SyncSection)

    @model_validator(mode="after")
    def _routes(self) -> Config:
        if not self.wants_routes:
            return self
        why = "loss.routing_replay=engine / rollout.return_routes"
        if self.rollout.env is not None:
            raise ValueError(f"{why}: multi-turn episodes (rollout.env) carry no routes yet")
        return self

    @property
    def wants_routes(self) -> bool:
        """The engines are asked for routes (replay on, or the agreement metric asked for)."""
        return self.loss.routing_replay == "engine" or self.rollout.return_routes

    @model_validator(mode="after")
    def _lora_only(self) -> Config:
        if self.sync.lora_only and self.lora.rank == 0:
            raise ValueError("sync.lora_only needs LoRA training: set lora.rank > 0")
        return self

    @model_validator(mode="after")
    def _batch_divides(self) -> Config:
        rows = self.trainer.prompts_per_step * self.rollout.group_size
        if rows % self.trainer.micro_batches:
            raise ValueError(
                f"trainer.micro_batches={self.trainer.micro_batches} must divide the batch of "
                f"trainer.prompts_per_step * rollout.group_size = {rows} rows"
            )
        return self


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `tree[a][b]... = value` for ``dotted = "a.b..."``, checking each key exists."""
    keys = dotted.split(".")
    model: type[BaseModel] = Config
    node = tree
    for i, key in enumerate(keys):
        fields = model.model_fields
        if key not in fields:
            where = ".".join(keys[:i]) or "the top level"
            raise ConfigError(
                f"unknown key {dotted!r}: {where} has no {key!r}; known: {sorted(fields)}"
            )
        if i == len(keys) - 1:
            node[key] = value
            return
        sub = fields[key].annotation
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            raise ConfigError(f"unknown key {dotted!r}: {'.'.join(keys[: i + 1])} is not a section")
        model = sub
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(keys[: i + 1])} must be a mapping; got {child!r}")
        node = child


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["trainer.steps=3", "rollout.backend=jax"]`` -> a nested dict; values are YAML scalars.

    Raises:
      ConfigError: for an item without "=" or a key the config does not have.
    """
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected section.key=value")
        _set(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return tree


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    if not first["loc"]:  # a rule across fields: the message names them
        return f"config: {first['msg']}"
    loc = ".".join(str(p) for p in first["loc"])
    return f"{loc}: {first['msg']} (got {first.get('input')!r})"


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping of sections in a YAML config file (an empty file gives {}).

    Raises:
      ConfigError: the file does not exist, or its top level is not a mapping.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist")
    loaded = yaml.safe_load(file.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file}: expected a mapping of sections, got {type(loaded).__name__}")
    return loaded


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), **sections: Any
) -> Config:
    """Validate a YAML file (optional), then `sections` (dicts by section name), then overrides.

    Raises:
      ConfigError: for a missing file, YAML that is not a mapping, an unknown key or a value out
        of range; the message names the dotted key.
    """
    data = read_yaml(path) if path is not None else {}
    data = _merge(data, sections)
    data = _merge(data, parse_overrides(overrides))
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None
