"""The rollout backend seam: what the engine worker loop needs from vLLM or the JAX batcher.

A backend takes prompts continuously (many `generate` calls in flight at once, each a group
of G samples of one prompt), returns token ids with the log-prob of each sampled token under
the sampling distribution and the weight versions that produced them, and swaps in a whole new
weight version on `update_weights`. No ML library is imported here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transport.manifest import Manifest


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one group.

    Attributes:
        n: group size G (samples per prompt), >= 1.
        max_tokens: most new tokens per sample.
        temperature: softmax temperature; 0 is greedy. Log-probs are of the distribution
            actually sampled from (logits / temperature, after top-k/top-p).
        top_p, top_k: nucleus and top-k filters (1.0 and -1 turn them off).
        seed: per-request seed, or None for the engine's.
        stop_token_ids: extra token ids that end a sample (EOS always does unless
            `ignore_eos`).
        ignore_eos: keep sampling past EOS (benchmarks and tests only).
    """

    n: int = 1
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"n and max_tokens must be >= 1, got {self.n}, {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens `[start, end)` of a sample were sampled with weight `version`."""

    version: int
    start: int
    end: int


@dataclass(frozen=True)
class Sample:
    """One completion.

    Attributes:
        token_ids: sampled token ids, `[L]` ints.
        logprobs: log-prob of each sampled token under the sampling distribution, `[L]`
            floats (natural log).
        finish_reason: `"stop"` (EOS or a stop token) or `"length"` (hit `max_tokens`; the last
            token is the one sampled there, with its log-prob).
        versions: spans covering `[0, L)`, oldest first; more than one when a weight update
            happened while this sample was being generated.
        forced_positions: indices into `token_ids` (ascending) of tokens the engine wrote
            without sampling them (the JAX engine's end-of-think phrase); empty for vLLM.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    versions: tuple[VersionSpan, ...]
    forced_positions: tuple[int, ...] = ()


@dataclass(frozen=True)
class GroupResult:
    """The G samples of one prompt, in sample-index order."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class UpdateStats:
    """One weight update: version, payload bytes, seconds paused and seconds end to end."""

    version: int
    num_bytes: int
    paused_s: float
    total_s: float
    phases: dict[str, float] = field(default_factory=dict)


class RolloutBackend(ABC):
    """One rollout engine (vLLM or JAX) as the worker loop drives it."""

    @abstractmethod
    async def start(self) -> None:
        """Load the model and get ready to serve (weight version = the initial one)."""

    @abstractmethod
    async def generate(
        self, prompt_id: str, prompt_token_ids: list[int], sampling: SamplingConfig
    ) -> GroupResult:
        """Sample `sampling.n` completions of one prompt; many calls may run at once.

        Raises:
            ValueError: an empty prompt, or a prompt plus `max_tokens` over the context.
            RuntimeError: the backend holds no whole weight version (a failed update).
        """

    @abstractmethod
    async def connect_transport(
        self, transport: dict[str, Any], rank_offset: int = 1, world_size: int | None = None
    ) -> None:
        """Join the data plane the gateway agreed (a `transport.config` dict).

        Args:
            transport: the transport settings, including the sender's rendezvous address.
            rank_offset: this engine's first rank in the transport group (the sender is 0).
            world_size: ranks in the group, or None for 1 + this engine's ranks.

        Raises:
            TransferError: the rendezvous failed or timed out.
        """

    @abstractmethod
    async def update_weights(self, manifest: Manifest) -> UpdateStats:
        """Receive and install the version `manifest` describes, through the data plane.

        Checks the manifest against the model before anything is loaded; on a refusal the
        backend keeps serving the version it had.

        Raises:
            ManifestError: the manifest does not fit the model (names listed).
            TransferError: the transfer failed; if it failed after some tensors were loaded
                the backend refuses to serve until a later update succeeds.
        """

    @property
    @abstractmethod
    def weight_version(self) -> int | None:
        """The version served now, or None while no whole version is held."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and release its resources."""
