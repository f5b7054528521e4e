"""Typed messages of the client API: what the trainer and engines hand to and get from
`GatewayClient`. `gateway.convert` turns them into protos and back.

These are also the rollout record end to end: a backend (`rollout_engine.backend`) returns
`Completion`s, the proto carries them, and the trainer's batch (`trainer.batch`) reads the same
`Completion` (scored: `reward` set). A completion is one type in memory and one on the wire.

Token ids are int32 vocabulary indices; log-probs are float32 natural logs of the sampled
token's probability under the sampling distribution; versions are published weight versions.
Arrays stay numpy arrays wherever a record is held in memory.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gateway.config import RunSettings  # the Configure message; defined beside the server config

FINISH_REASONS = ("stop", "length", "abort")
SYNC_PHASES = ("ready", "loaded", "failed")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample a prompt's G completions: the one sampling type of the project, from the
    trainer's config through the wire to both engines (see protos/rollout.proto for the
    ranges; `gateway.validate` checks them at submission).

    Attributes:
        temperature: softmax temperature (>= 0; 0 is greedy). Log-probs are of the
            distribution actually sampled from (logits / temperature, then top-k, top-p).
        top_p: nucleus mass in (0, 1]; 1.0 is off.
        top_k: keep the k most likely tokens; 0 is off (the one convention for "off").
        max_new_tokens: most completion tokens (>= 1), the last one included.
        stop_token_ids: extra ids that end a completion (EOS always does, unless ignore_eos).
        seed: the sampler's seed, or None for the engine's.
        reasoning_budget: > 0: thinking tokens before the engine forces end-of-think (the JAX
            engine sets it per engine; a prompt asking for one is refused by the backends).
        ignore_eos: keep sampling past EOS until max_new_tokens (benchmarks and tests).
        return_routes: a mixture-of-experts engine records each completion's routed experts
            (`Completion.routed_experts`, routing replay); a dense model's returns none.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    reasoning_budget: int = 0
    ignore_eos: bool = False
    return_routes: bool = False


@dataclasses.dataclass(frozen=True)
class Episode:
    """A prompt's samples as multi-turn episodes with an environment
    (`rollout_engine.episode`): each of the G samples is one episode.

    Attributes:
        env: the environment's registry name (`envs.registry`), e.g. "calculator".
        task_json: the task's fields as a JSON object (what `Environment.reset` reads).
        max_turns: model turns at most (>= 1).
        max_tokens: tokens after the prompt at most, model and environment together (>= 1);
            the episode's completion is at most this long.
        max_observation_chars: an observation is cut to this many characters (>= 1).
    """

    env: str
    task_json: str = "{}"
    max_turns: int = 4
    max_tokens: int = 1024
    max_observation_chars: int = 1024


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt to complete `group_size` times.

    Attributes:
        sample_id: unique among prompts in flight.
        token_ids: int32 [P], P >= 1.
        group_size: G >= 1.
        sampling: sampling parameters.
        is_eval: eval prompts are leased before training prompts.
        min_version: only engines holding at least this weight version may lease it.
        episode: None: G completions of one turn each; else G multi-turn episodes (each
            turn sampled with `sampling`, its `max_new_tokens` a per-turn bound).
        continues: (not on the wire) the prompt extends an earlier prompt and completion on
            the same engine (an episode's next turn, `rollout_engine.episode`): a backend may
            reuse their KV cache (the JAX engine's slot memory; vLLM's prefix cache does so
            for every prompt).
    """

    sample_id: str
    token_ids: np.ndarray
    group_size: int
    sampling: SamplingParams = SamplingParams()
    is_eval: bool = False
    min_version: int = 0
    episode: Episode | None = None
    continues: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Completion:
    """One sampled completion: the rollout record from the backend to the loss.

    Attributes:
        token_ids: int32 [L] generated tokens (prompt excluded), EOS included when the engine
            stopped on it; lists are turned into arrays on construction.
        logprobs: float32 [L] log-prob of each sampled token under the sampling distribution
            (the engine's processed log-probs, after temperature and truncation).
        finish_reason: "stop", "length" or "abort".
        version_start, version_end: weight versions at the first and the last token.
        version_spans: (version, start token, end token) triples covering [0, L) oldest first
            (the backends always send them; more than one when the version changed while the
            completion was generated); () means version_start produced every token.
        first_token_s, generation_s: seconds from the engine taking the prompt.
        forced_positions: indices into token_ids (ascending) of tokens the engine wrote without
            sampling them (log-prob 0); the trainer masks them out of the loss.
        turns: model turns of a multi-turn episode (>= 1), 0 for a single-turn completion.
        observations: environment messages appended between the episode's turns (tool
            results, a game's feedback); their tokens are among `forced_positions`.
        env_reward: the environment's own reward of the episode (a game's checker), or None
            when it does not score one (the verifier then scores the last model turn).
        routed_experts: int32 [P + L - 1, layers, k], the experts each MoE layer chose in
            each forward pass the engine ran over the sample (routing replay; row i: the pass
            over token i of prompt + completion; `gateway.routes`), or None (a dense model, or
            routes not asked for). Its length is checked against the prompt's where the prompt
            is known (the gateway's `check_group`, `trainer.rollouts.RolloutGroup`).
        reward: the verifier's score, set by the trainer (None until scored; not on the wire).
        text: the decoded completion, when someone decoded it (not on the wire).

    Construction does not validate (the gateway checks what engines return and says why, see
    `gateway.validate`); `validate` does, for the trainer.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    version_start: int
    version_end: int
    version_spans: tuple[tuple[int, int, int], ...] = ()
    first_token_s: float = 0.0
    generation_s: float = 0.0
    forced_positions: tuple[int, ...] = ()
    turns: int = 0
    observations: int = 0
    env_reward: float | None = None
    routed_experts: np.ndarray | None = None
    reward: float | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", np.asarray(self.token_ids, np.int32))
        object.__setattr__(self, "logprobs", np.asarray(self.logprobs, np.float32))
        object.__setattr__(self, "forced_positions", tuple(int(j) for j in self.forced_positions))
        object.__setattr__(
            self, "version_spans", tuple((int(v), int(a), int(b)) for v, a, b in self.version_spans)
        )
        if self.routed_experts is not None:
            object.__setattr__(self, "routed_experts", np.asarray(self.routed_experts, np.int32))

    def validate(self) -> None:
        """Check the record the trainer trains on.

        Raises:
            ValueError: token ids and log-probs of different lengths, versions negative or out
                of order, an empty finish reason, a forced position outside the completion,
                episode counts out of range (observations < turns), a non-finite env reward,
                a version span outside [version_start, version_end] x [0, L] (the gateway's
                check, `gateway.validate`), or routed experts not [rows, layers, k] or negative.
        """
        n = len(self.token_ids)
        if n != len(self.logprobs):
            raise ValueError(
                f"token_ids and logprobs must align; got {n} ids and {len(self.logprobs)} log-probs"
            )
        if not 0 <= self.version_start <= self.version_end:
            raise ValueError(
                "need 0 <= version_start <= version_end; got "
                f"{self.version_start}, {self.version_end}"
            )
        if not self.finish_reason:
            raise ValueError("finish_reason must be a non-empty string")
        if any(not 0 <= j < n for j in self.forced_positions):
            raise ValueError(
                f"forced_positions must index the {n} completion tokens; "
                f"got {list(self.forced_positions)[:8]}"
            )
        if self.turns < 0 or not 0 <= self.observations <= max(self.turns - 1, 0):
            raise ValueError(
                "need turns >= 0 and 0 <= observations < turns; got "
                f"{self.turns} turns, {self.observations} observations"
            )
        if self.env_reward is not None and not np.isfinite(self.env_reward):
            raise ValueError(f"env_reward must be finite; got {self.env_reward}")
        r = self.routed_experts
        if r is not None and (r.ndim != 3 or (r.size and r.min() < 0)):
            raise ValueError(
                f"routed_experts must be [rows, layers, k] expert ids >= 0; got shape {r.shape}"
            )
        v0, v1 = self.version_start, self.version_end
        for v, a, b in self.version_spans:
            if not (v0 <= v <= v1 and 0 <= a <= b <= n):
                raise ValueError(
                    f"version spans must lie within versions [{v0}, {v1}] and tokens [0, {n}]; "
                    f"got version {v} tokens [{a}, {b})"
                )

    def token_versions(self) -> np.ndarray:
        """int32 [L]: the weight version that sampled each token, from `version_spans` (spans
        apply in order; a token no span covers, or every token when there are none, gets
        version_start, the oldest: a conservative stamp for the lag)."""
        out = np.full(len(self.token_ids), self.version_start, np.int32)
        for v, a, b in self.version_spans:
            out[a:b] = v
        return out


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
    """A prompt's G completions. Engines fill sample_id and completions; the gateway adds
    engine_id, the prompt, and the seconds spent queued (queue_s) and leased (lease_s)."""

    sample_id: str
    completions: tuple[Completion, ...]
    engine_id: str = ""
    prompt: Prompt | None = None
    queue_s: float = 0.0
    lease_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What an engine says about itself when it registers."""

    backend: str
    model_family: str
    dtype: str
    transports: tuple[str, ...]
    device_count: int = 1
    tp_size: int = 1
    name: str = ""
    weight_version: int = 0
    host: str = ""
    adapter: str = ""
    """The LoRA adapter it serves adapter-only versions of (`RunSettings.adapter`); empty:
    full-weight versions."""


@dataclasses.dataclass(frozen=True)
class SyncDirective:
    """Load `target_version` at the next safe point; `params` come from the trainer; `seq`
    is the publication (bumped by every publish, re-plans included) that an ack of this
    directive names back (`GatewayClient.ack_version`), 0 when unknown."""

    target_version: int
    params: dict[str, str]
    seq: int = 0


@dataclasses.dataclass(frozen=True)
class Registration:
    """An accepted engine: its id, the agreed settings and the timing it must keep.

    `engine_key` is the secret every later call about this engine carries (the client that
    registered keeps it and sends it by itself; give it to another client with
    `GatewayClient.adopt_engine`). Only calls carrying it keep the engine alive.
    """

    engine_id: str
    settings: RunSettings
    current_version: int
    sync: SyncDirective | None
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    lease_seconds: float
    engine_key: str = dataclasses.field(default="", repr=False)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A heartbeat's answer."""

    sync: SyncDirective | None
    current_version: int
    shutting_down: bool


@dataclasses.dataclass(frozen=True)
class Lease:
    """Prompts leased to one engine; empty `prompts` (and lease_id) when none came."""

    lease_id: str
    prompts: tuple[Prompt, ...]
    expires_in_s: float
    sync: SyncDirective | None
    shutting_down: bool
    backpressure: bool


@dataclasses.dataclass(frozen=True)
class ReturnResult:
    """Groups accepted, dropped (late or repeated, with the reason) and prompts released."""

    accepted: int
    dropped: int
    dropped_reason: str
    released: int


@dataclasses.dataclass(frozen=True)
class EngineSyncState:
    """The last sync progress an engine reported.

    Attributes:
        engine_id: the engine.
        version: the last version it acknowledged a phase for.
        phase: "ready", "loaded" or "failed" ("unspecified" before any ack).
        error: why the load failed (phase "failed" only).
        serving: the engine holds a whole version and may lease; false only after a
            "failed" that left it without one, until it loads a version.
    """

    engine_id: str
    version: int
    phase: str
    error: str
    serving: bool = True


@dataclasses.dataclass(frozen=True)
class SyncResult:
    """WaitSync's answer: done when every live engine reached the phase."""

    done: bool
    engines: tuple[EngineSyncState, ...]
