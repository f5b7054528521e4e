"""The main job's config: the run's `trainer.config.Config` plus the data, eval and launch
sections. Imports no ML library, so `python -m trainer train --help` and a bad key answer at once.

One YAML file holds every section::

    model: {path: smollm2}            # an HF folder, "smollm2" or "tiny:VARIANT"
    trainer: {steps: 30, ...}         # trainer.config sections, validated there
    rollout: {backend: vllm, ...}
    data: {source: reasoning_gym, task: chain_sum, task_config: {min_terms: 2, max_terms: 2}}
    eval: {size: 32}
    launch: {num_engines: 1}
    logging: {wandb: {mode: offline, samples_every: 5}}

Overrides are ``section.key=value`` (YAML scalars; ``logging.wandb.key=value`` one level
deeper); ``run_dir=PATH`` is short for
``trainer.run_dir=PATH``. A wrong key or value raises `ConfigError` naming it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from trainer.config import Config, ConfigError, load_config, read_yaml
from trainer.data.answer_forms import AnswerForm

JOB_SECTIONS = ("data", "eval", "launch", "logging")
ALIASES = {"run_dir": "trainer.run_dir"}


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, use_attribute_docstrings=True
    )


class DataSection(_Section):
    """Where training and held-out problems come from."""

    source: Literal["reasoning_gym", "gsm8k", "jsonl"] = "reasoning_gym"
    """reasoning_gym (procedural, offline), gsm8k (a GSM8K JSONL file, math-verify) or jsonl
    (any JSONL file: prompt_template over its fields, answer_field read as answer_form,
    math-verify)."""
    task: str = "chain_sum"
    """reasoning-gym dataset name (source=reasoning_gym)."""
    task_config: dict[str, Any] = Field(default_factory=dict)
    """reasoning-gym dataset settings, e.g. {min_terms: 2, max_terms: 2}."""
    size: int = Field(default=2000, ge=1)
    """Training problems (reasoning-gym: generated; gsm8k: the first `size` lines)."""
    path: str = "data/gsm8k/train.jsonl"
    """Training JSONL (source=gsm8k or jsonl); relative paths are from the working folder. The
    default is an example location: point it at your copy of GSM8K's train.jsonl."""
    eval_path: str = ""
    """Held-out JSONL (gsm8k, jsonl); empty: the held-out split is the last eval.size lines of
    `path` (never trained on). reasoning-gym's held-out split uses seed trainer.seed + 1."""
    prompt_template: str = "{question}"
    """source=jsonl: the question shown to the model, a str.format template over the row's
    fields, e.g. "{Body} {Question}"."""
    answer_field: str = "answer"
    """source=jsonl: the row's field holding the gold answer."""
    answer_form: AnswerForm = "auto"
    """source=jsonl: how the gold is written in answer_field: number, hash (after '####'),
    boxed (the last \\boxed{}), regex (answer_regex's match, its group 1 if any) or auto."""
    answer_regex: str = ""
    """source=jsonl, answer_form=regex: the pattern."""
    max_new_tokens_field: str = ""
    """source=jsonl: the row's field holding that problem's own completion budget for training
    rollouts (an integer 1..rollout.max_new_tokens, sent as the prompt's max_new_tokens: a
    per-prompt length mix); empty: every prompt gets rollout.max_new_tokens."""
    limit: int | None = Field(default=None, ge=1)
    """source=gsm8k or jsonl: rows read from the top of each file; None: all."""
    verifier: str | None = None
    """Verifier registry name scoring every problem; None: the source's own (reasoning-gym's
    checker of the last line or <answer> tag; math-verify for gsm8k). "math" scores
    reasoning-gym arithmetic by the final number of a free-form answer."""
    system_prompt: str | None = None
    """System message of the chat template; None: the tokenizer's default."""
    suffix: str = ""
    """Text appended to every question (an instruction on the answer format)."""

    @model_validator(mode="after")
    def _jsonl_keys(self) -> DataSection:
        from trainer.data.jsonl_problems import template_fields

        template_fields(self.prompt_template)  # a bad template fails at config time
        if self.answer_form == "regex":
            if not self.answer_regex:
                raise ValueError("data.answer_form=regex needs data.answer_regex")
            try:
                re.compile(self.answer_regex)
            except re.error as err:
                raise ValueError(f"data.answer_regex {self.answer_regex!r}: {err}") from None
        return self


class EvalSection(_Section):
    """Held-out accuracy before, during (eval.every) and after training, through the same
    engines (eval prompts)."""

    size: int = Field(default=32, ge=0)
    """Held-out problems; 0 switches the evaluation off."""
    samples: int = Field(default=1, ge=1)
    """Completions per held-out problem; accuracy is their mean reward."""
    temperature: float | None = Field(default=None, ge=0)
    """Eval sampling temperature (0: greedy); None: rollout.temperature. Both engines take it
    per request, so greedy evaluation runs on the engines that sample training at T=1."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """None: rollout.max_new_tokens."""
    every: int = Field(default=0, ge=0)
    """Evaluate the held-out split every `every` training steps, at the weight version of that
    step, on the running engines (`trainer.launch.eval_every`); each evaluation, and those
    before and after training, is then a row of metrics.jsonl (eval/accuracy, pass@k, maj@k,
    ...). 0: only before and after training."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds of silence (no group coming back) after which an evaluation, or the drain of
    in-flight training groups after the stop, fails; the whole evaluation may take longer."""
    data: str = ""
    """`python -m trainer eval`: a benchmark name (gsm8k, aime24, amc23, minerva: local files,
    see trainer.eval.benchmarks) or a PATH.jsonl read with the data.* keys; empty: data.path
    read as data.source (gsm8k or jsonl)."""
    out_dir: str = ""
    """`python -m trainer eval`: the output folder (summary.json, completions.jsonl, logs/);
    empty: runs/eval."""


class LaunchSection(_Section):
    """The processes the launcher starts on the local machine."""

    num_engines: int = Field(default=1, ge=1)
    """Engine processes."""
    min_engines: int = Field(default=1, ge=1)
    """Fewest engines the run goes on with: a push commits on the engines that survive it
    while at least this many serve; below that the run fails naming them."""
    restart_engines: bool = True
    """Restart an engine process the launcher started when it dies (bounded, see below)."""
    max_restarts: int = Field(default=5, ge=0)
    """Most restarts of one engine over the run; past them a dead engine stays dead."""
    restart_backoff_s: float = Field(default=1.0, gt=0)
    """Seconds before an engine's first restart; doubled for each further one of it."""
    restart_backoff_max_s: float = Field(default=60.0, gt=0)
    """Cap of that wait (seconds)."""
    engine_rejoin_s: float = Field(default=300.0, ge=0)
    """Seconds an engine that lost the gateway (dropped after engine_heartbeat_timeout_s of
    silence, or unreachable) keeps trying to register again (`--rejoin-s`); back, it loads the
    current version before any lease. Past it the engine exits (status 3) and, if
    restart_engines, the launcher restarts it. 0: it exits at once."""
    engine_heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    """The gateway drops an engine silent for this many seconds (its leases go back to the
    queue at once; `--heartbeat-timeout`)."""
    engine_backends: tuple[Literal["vllm", "jax"], ...] = ()
    """Backend of each engine (index i: engine i), for a run that mixes them; empty: every
    engine runs rollout.backend. Its length must equal num_engines."""
    devices_per_engine: int = Field(default=1, ge=1)
    """Devices each engine gets (CPU: XLA host devices; GPU: CUDA_VISIBLE_DEVICES ids)."""
    trainer_devices: int = Field(default=1, ge=1)
    """Devices of the trainer's mesh (GPU: the ids after the engines'); with
    trainer_processes > 1, the devices of each trainer process."""
    trainer_processes: int = Field(default=1, ge=1)
    """Trainer processes on the local machine, joined under jax.distributed (one global mesh over
    all their devices; `trainer.launch.trainer_processes`); 1: the trainer runs in the
    launching process itself."""
    trainer_heartbeat_timeout_s: int = Field(default=100, ge=1)
    """With trainer_processes > 1: seconds without a jax.distributed heartbeat after which JAX
    counts a trainer process as dead and ends the job: how soon a hung or lost process is
    found when no launcher watches the processes (on a cluster; the launcher stops the job as
    soon as one exits). JAX's default; short values kill healthy jobs on a loaded host."""
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    """auto: gpu when nvidia-smi is on PATH, else cpu."""
    engine_dtype: Literal["float32", "bfloat16"] | None = None
    """Engine dtype and weight-push wire dtype; None: bfloat16 for vllm, float32 for jax (the
    faster one of each on CPU)."""
    gateway: str = ""
    """HOST:PORT of a gateway started elsewhere: then this process only trains (no gateway or
    engines started here) and waits for num_engines engines to register. Empty: start both."""
    stop_joined: bool = False
    """With launch.gateway: shut that gateway (and with it its engines) down when this run
    ends, finished or failed; False leaves it serving either way."""
    token_file: str = ""
    """Token file of that gateway (`python -m gateway make-tokens`); empty: RUN_DIR/tokens.txt."""
    gateway_ca_file: str = ""
    """With launch.gateway: the PEM certificate to trust (`python -m gateway make-cert`); given,
    the trainer talks to that gateway over TLS only. Empty: plaintext."""
    gateway_wait_s: float = Field(default=30.0, gt=0)
    """With launch.gateway: seconds to wait for that gateway to answer before the run stops
    with an error naming it."""
    host: str = "127.0.0.1"
    """Interface the gateway listens on."""
    data_plane_host: str = "127.0.0.1"
    """Address engines reach the trainer's data-plane rendezvous at (the local host's, as seen by
    them)."""
    data_plane_port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the data plane's rendezvous store (on data_plane_host only); 0 picks a free
    one. gloo/NCCL open further ports of the kernel's choosing (docs/clusters.md, "Ports")."""
    data_plane_port_count: int = Field(default=1, ge=1, le=65535)
    """With data_plane_port > 0: the store takes the first free port of
    data_plane_port..data_plane_port+data_plane_port_count-1."""
    data_plane_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds allowed for the data plane's rendezvous and for each of its collectives."""
    data_plane: Literal["auto", "gloo", "nccl", "file", "shm", "jax_transfer", "delta_stream"] = (
        "auto"
    )
    """Weight transport: auto is nccl when the accelerator is gpu and the engines are vLLM
    (buckets move GPU to GPU, each TP rank receiving only its shard), else gloo (TCP). file:
    each version as files in data_plane_root, a folder every engine sees at the same path (a
    shared filesystem: engines far from the trainer). shm: each version as one shared-memory
    segment in data_plane_root (a tmpfs) that the engines map: every engine on the
    trainer's host (`transport.shm`). jax_transfer: every trainer process serves its own
    shards through `jax.experimental.transfer` and each JAX engine pulls them onto its device
    (ICI/DCN on TPU, device to device on GPU, TCP on CPU; JAX engines only,
    `transport.jax_transfer`). delta_stream: the trainer listens on
    data_plane_host:data_plane_port and each engine pulls the newest version over its own TCP
    stream as a zstd-compressed XOR delta against the version it holds (a keyframe when it
    holds none the trainer keeps): engines behind slow links, far from the trainer
    (`transport.delta_stream`, docs/clusters.md "Far engines")."""
    data_plane_root: str = ""
    """With data_plane=file: the shared folder of the versions; empty: RUN_DIR/weights. With
    data_plane=shm: the segments' folder on a tmpfs; empty: a new /dev/shm/jaxrl-PID-HEX,
    unlinked when the trainer closes its data plane."""
    file_delta: bool = False
    """With data_plane=file: write each version as a zstd-compressed delta against the one
    before it, a whole version every file_full_every (`transport.file_delta`)."""
    file_full_every: int = Field(default=10, ge=1)
    """With file_delta: a whole (keyframe) version every this many versions."""
    delta_full_every: int = Field(default=0, ge=0)
    """With data_plane=delta_stream: a keyframe to an engine after every delta_full_every - 1
    deltas it loaded; 0: only when it holds no version the trainer keeps, or refused one."""
    far_engines: tuple[int, ...] = ()
    """Indices of the engines fed over the delta stream while the others keep data_plane
    (gloo, shm or file): near and far engines in one job and one weight version sequence
    (docs/clusters.md "Near and far engines"). An engine is far when it registered as
    ``engine{i}`` or ``engine{i}-...`` for i listed here; the trainer never waits for a far
    engine to load (it pulls each version, or a newer one, as a delta against its own),
    and launch.min_engines counts near engines only. The far sender listens on
    data_plane_host:far_port with delta_keep and delta_full_every. Empty: every engine takes
    data_plane."""
    far_port: int = Field(default=0, ge=0, le=65535)
    """With far_engines: the TCP port of the far engines' delta stream (on data_plane_host);
    0 picks a free one (sent to the engines in each sync plan)."""
    delta_keep: int = Field(default=2, ge=1)
    """With data_plane=delta_stream: newest versions the trainer keeps as delta bases (each
    the model's bytes in the wire dtype, in host memory), besides each engine's held one."""
    tp_shards: bool = True
    """Engines at TP > 1 receive only their own shard of each split tensor; False sends every
    tensor whole to every TP rank (vLLM's loaders then take the shard)."""
    xla_cache: bool = True
    """JAX's persistent compilation cache for the trainer and the engines (see
    `trainer.launch.commands.xla_cache_env`): a restarted JAX engine or a rerun loads its
    compiled programs instead of compiling them again."""
    xla_cache_dir: str = ""
    """Folder of that cache; empty: $JAXRL_CACHE_DIR/xla (default ~/.cache/jaxrl/xla). A
    JAX_COMPILATION_CACHE_DIR already in the environment wins."""
    port: int = Field(default=0, ge=0, le=65535)
    """Gateway port; 0 picks a free one."""
    max_concurrent_prompts: int = Field(default=16, ge=1)
    """Prompt groups one engine generates at once."""
    jax_num_slots: int = Field(default=32, ge=1)
    """JAX engine: samples decoded together."""
    jax_prefill_batch: int = Field(default=8, ge=1)
    jax_steps_per_call: int = Field(default=16, ge=1)
    jax_tp: int = Field(default=1, ge=1)
    """JAX engine: tensor-parallel degree over its devices_per_engine devices (must divide it;
    the rest split the slots); params placed by the trainer's logical-axis rules, the KV
    cache split over its heads (docs/engines.md). 1: params replicated on every device."""
    jax_kv_cache_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """JAX engine: the KV cache's dtype; auto: the engine dtype. bfloat16 with
    engine_dtype=float32 keeps float32 matmuls and a bf16 cache read by the native kernel:
    the fast setting on a CPU without bf16 instructions (docs/engines.md)."""
    vllm_kv_cache_gib: int = Field(default=1, ge=1)
    """vLLM: KV cache GiB (VLLM_CPU_KVCACHE_SPACE on CPU)."""
    vllm_block_size: int = Field(default=0, ge=0)
    """vLLM: tokens per KV cache block; 0 keeps vLLM's own (128 on CPU, 16 on GPU). Its prefix
    cache holds whole blocks only: multi-turn episodes on CPU find more of their history
    again with 32 (docs/multi_turn.md)."""
    engine_env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of every engine process."""
    engine_cpus: str = Field(default="", pattern=r"^(\d+(-\d+)?(,\d+(-\d+)?)*)?$")
    """CPU cores every engine process is pinned to, a Linux CPU list ("0", "0-3,6"): its command
    runs under ``taskset -c`` (util-linux), so all its threads inherit the mask; empty: no
    pinning (the cores the launcher has). The trainer stays on the launcher's cores: run the
    job itself under ``taskset -c`` to pin it (``benchmarks/async_vs_sync.py`` does both)."""

    @field_validator("engine_cpus", mode="before")
    @classmethod
    def _one_core_as_text(cls, value: Any) -> Any:
        """``launch.engine_cpus=0`` reads as the int 0: take one core number as its text."""
        return str(value) if type(value) is int else value

    start_timeout_s: float = Field(default=600.0, gt=0)
    """Most seconds to wait for every engine to register."""
    stop_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a process gets to exit after SIGTERM before SIGKILL."""
    progress: bool = True
    """Show the progress bar."""


class WandbSection(_Section):
    """Weights & Biases, beside TensorBoard (`trainer.launch.wandb_log`): every metrics.jsonl
    row at its step, the job config, and a table of sample completions."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    """disabled: no W&B (wandb is not imported); offline: write the run under dir only (no
    network; `wandb sync DIR` uploads it later); online: stream to the W&B server (needs
    `wandb login` or WANDB_API_KEY)."""
    project: str = "jaxrl-bridge"
    """W&B project."""
    entity: str | None = None
    """W&B entity (user or team); None: the account's default."""
    name: str | None = None
    """Run name; None: the run folder's name."""
    tags: tuple[str, ...] = ()
    """Run tags."""
    dir: str = ""
    """Folder W&B writes its ``wandb/`` run folder under; empty: $WANDB_DIR, else the run
    folder."""
    samples_every: int = Field(default=10, ge=0)
    """Log a table of sample completions every this many steps (and at step 1); 0: never."""
    samples_per_table: int = Field(default=8, ge=1)
    """Most rows of one sample table (the first completion of each trained group, in order)."""
    init_timeout_s: float = Field(default=90.0, gt=0)
    """Seconds wandb.init may take before the job fails at startup."""


class LoggingSection(_Section):
    """Where metrics go besides metrics.jsonl and TensorBoard (always written)."""

    wandb: WandbSection = Field(default_factory=WandbSection)


class JobConfig(_Section):
    """A whole job: the run (`Config`) and how to launch and feed it."""

    run: Config
    data: DataSection = Field(default_factory=DataSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)

    @model_validator(mode="after")
    def _engines(self) -> JobConfig:
        launch = self.launch
        if launch.engine_backends and len(launch.engine_backends) != launch.num_engines:
            raise ValueError(
                f"launch.engine_backends: expected {launch.num_engines} entries (num_engines), "
                f"got {len(launch.engine_backends)}"
            )
        if launch.devices_per_engine % launch.jax_tp:
            raise ValueError(
                f"launch.jax_tp={launch.jax_tp} does not divide launch.devices_per_engine="
                f"{launch.devices_per_engine}"
            )
        if launch.min_engines > launch.num_engines:
            raise ValueError(
                f"launch.min_engines: expected <= num_engines={launch.num_engines}, "
                f"got {launch.min_engines}"
            )
        if launch.trainer_processes > 1 and self.logging.wandb.mode != "disabled":
            raise ValueError(
                f"logging.wandb.mode={self.logging.wandb.mode!r} with launch.trainer_processes="
                f"{launch.trainer_processes}: W&B logs from a single trainer process only (for "
                "now); use TensorBoard and metrics.jsonl, or launch.trainer_processes=1"
            )
        if self.run.sync.lora_only and launch.trainer_processes > 1:
            raise ValueError(
                f"sync.lora_only with launch.trainer_processes={launch.trainer_processes}: "
                "adapter-only pushes go from one trainer process (for now)"
            )
        if self.run.wants_routes and launch.trainer_processes > 1:
            raise ValueError(
                "loss.routing_replay=engine / rollout.return_routes need "
                f"launch.trainer_processes=1 (got {launch.trainer_processes}): the batch's "
                "routes are not shared across trainer processes yet"
            )
        return self

    def backend_of(self, index: int) -> str:
        """The backend of engine `index` (launch.engine_backends, else rollout.backend)."""
        backends = self.launch.engine_backends
        return backends[index] if backends else self.run.rollout.backend

    @property
    def backends(self) -> tuple[str, ...]:
        """Every backend the run's engines use, once each in engine order
        (launch.engine_backends, else rollout.backend alone)."""
        return tuple(dict.fromkeys(self.launch.engine_backends)) or (self.run.rollout.backend,)

    @model_validator(mode="after")
    def _mesh_fits_devices(self) -> JobConfig:
        """The train mesh dp x fsdp x ep x tp must tile the trainer's devices
        (launch.trainer_devices on each of launch.trainer_processes processes)."""
        t, devices = self.run.trainer, self.launch.trainer_devices * self.launch.trainer_processes
        axes = {"dp": t.dp, "ep": t.ep, "tp": t.tp} if t.ep > 1 else {"dp": t.dp, "tp": t.tp}
        if devices % math.prod(axes.values()):
            raise ValueError(
                f"{' x '.join('trainer.' + a for a in axes)} = "
                f"{' x '.join(map(str, axes.values()))} does not divide the trainer's "
                f"{devices} devices (launch.trainer_devices x launch.trainer_processes)"
            )
        axes = {"dp": t.dp, "fsdp": t.fsdp, **{k: v for k, v in axes.items() if k != "dp"}}
        if t.fsdp != -1 and math.prod(axes.values()) != devices:
            raise ValueError(
                f"trainer.{' x '.join(axes)} = {' x '.join(map(str, axes.values()))} = "
                f"{math.prod(axes.values())}, but the trainer has {devices} devices "
                "(launch.trainer_devices x launch.trainer_processes)"
            )
        return self

    @model_validator(mode="after")
    def _port_range(self) -> JobConfig:
        launch = self.launch
        last = launch.data_plane_port + launch.data_plane_port_count - 1
        if launch.data_plane_port and last > 65535:
            raise ValueError(
                f"launch.data_plane_port={launch.data_plane_port} with data_plane_port_count="
                f"{launch.data_plane_port_count} runs past port 65535"
            )
        far = launch.far_engines
        if far and (len(set(far)) != len(far) or not all(0 <= i < launch.num_engines for i in far)):
            raise ValueError(
                f"launch.far_engines: expected distinct indices 0..{launch.num_engines - 1} "
                f"(num_engines={launch.num_engines}), got {list(far)}"
            )
        if far and len(far) == launch.num_engines:
            raise ValueError(
                f"launch.far_engines={list(far)} lists every engine: a mixed plan needs a near "
                "engine; for far engines only use launch.data_plane=delta_stream"
            )
        if far and launch.data_plane in ("nccl", "jax_transfer", "delta_stream"):
            raise ValueError(
                f"launch.far_engines with launch.data_plane={launch.data_plane}: near engines "
                "beside far ones take gloo, shm or file (a whole version from one trainer "
                "process; NCCL and jax_transfer keep it on devices)"
            )
        if far and launch.min_engines > launch.num_engines - len(far):
            raise ValueError(
                f"launch.min_engines={launch.min_engines} with launch.far_engines={list(far)}: "
                f"a push commits on near engines only, and there are "
                f"{launch.num_engines - len(far)}"
            )
        if far and launch.trainer_processes > 1:
            raise ValueError(
                f"launch.far_engines with launch.trainer_processes={launch.trainer_processes}: "
                "far engines are fed from trainer process 0's whole version (one process)"
            )
        if launch.file_delta and launch.data_plane != "file":
            raise ValueError(
                f"launch.file_delta=true needs launch.data_plane=file; got {launch.data_plane}"
            )
        return self

    @property
    def engine_dtype(self) -> str:
        """The engines' dtype (also the wire dtype of weight pushes)."""
        if self.launch.engine_dtype is not None:
            return self.launch.engine_dtype
        return "bfloat16" if self.run.rollout.backend == "vllm" else "float32"

    @property
    def eval_temperature(self) -> float:
        """The eval sampling temperature."""
        t = self.eval.temperature
        return self.run.rollout.temperature if t is None else t

    @property
    def run_dir(self) -> Path:
        """The run folder (trainer.run_dir)."""
        return Path(self.run.trainer.run_dir)


def _split_override(item: str) -> tuple[str, str]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected section.key=value")
    return ALIASES.get(key, key), raw


def _set_job(tree: dict[str, Any], key: str, raw: str) -> None:
    section, _, rest = key.partition(".")
    model = JobConfig.model_fields[section].annotation
    node = tree.setdefault(section, {})
    while True:
        assert isinstance(model, type) and issubclass(model, BaseModel)
        name, _, rest = rest.partition(".")
        if name not in model.model_fields:
            raise ConfigError(
                f"unknown key {key!r}: {section} has no {name!r}; known: "
                f"{sorted(model.model_fields)}"
            )
        sub = model.model_fields[name].annotation
        nested = isinstance(sub, type) and issubclass(sub, BaseModel)
        if nested != bool(rest):
            raise ConfigError(f"unknown key {key!r}: {section}.{name} " + (
                f"is a section; set one of its keys: {sorted(sub.model_fields)}"  # type: ignore[union-attr]
                if nested else "has no sub-keys"
            ))  # fmt: skip
        if not nested:
            node[name] = yaml.safe_load(raw) if raw.strip() else None
            return
        node, model, section = node.setdefault(name, {}), sub, f"{section}.{name}"


def load_job_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Validate a job YAML (optional) and ``key=value`` overrides.

    The model/trainer/loss/optim/rollout sections go to `trainer.config.load_config`; data, eval
    and launch are validated here.

    Raises:
      ConfigError: a missing file, YAML that is not a mapping, an unknown key or a bad value;
        the message names the dotted key.
    """
    data = read_yaml(path) if path is not None else {}
    job = {k: dict(data.pop(k) or {}) for k in JOB_SECTIONS if k in data}
    run_overrides = []
    for item in overrides:
        key, raw = _split_override(item)
        if key.partition(".")[0] in JOB_SECTIONS:
            _set_job(job, key, raw)
        else:
            run_overrides.append(f"{key}={raw}")
    run = load_config(None, run_overrides, **data)
    try:
        return JobConfig.model_validate({"run": run, **job})
    except ValidationError as err:
        first = err.errors()[0]
        if not first["loc"]:
            raise ConfigError(f"config: {first['msg']}") from None
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{loc}: {first['msg']} (got {first.get('input')!r})") from None
