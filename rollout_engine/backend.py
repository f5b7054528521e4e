"""The rollout backend seam: what the engine worker loop needs from vLLM or the JAX batcher.

A backend takes prompts continuously (many `generate` calls in flight at once, each a group
of G samples of one leased `gateway.messages.Prompt`), returns `gateway.messages.Completion`s
(token ids with the log-prob of each sampled token under the sampling distribution and the
weight versions that produced them; the record the trainer reads, no conversion between), and
swaps in a whole new weight version on `update_weights`. No ML library is imported here.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway import messages as m

if TYPE_CHECKING:
    from transport.manifest import Manifest


def check_prompt(prompt: m.Prompt) -> None:
    """Refuse a leased prompt a backend cannot serve (the worker returns it aborted).

    Raises:
        ValueError: an empty prompt, group size or max_new_tokens < 1, a negative temperature,
            or a per-prompt reasoning budget (the JAX engine sets it per engine).
    """
    s = prompt.sampling
    if len(prompt.token_ids) == 0:
        raise ValueError(f"prompt {prompt.sample_id!r} is empty")
    if prompt.group_size < 1 or s.max_new_tokens < 1:
        raise ValueError(
            f"prompt {prompt.sample_id!r}: group_size and max_new_tokens must be >= 1, got "
            f"{prompt.group_size}, {s.max_new_tokens}"
        )
    if s.temperature < 0:
        raise ValueError(
            f"prompt {prompt.sample_id!r}: temperature must be >= 0, got {s.temperature}"
        )
    if s.reasoning_budget:
        raise ValueError(
            f"prompt {prompt.sample_id!r}: reasoning_budget={s.reasoning_budget} per prompt is "
            "not supported by the backend seam; expected 0 (set it in the engine config)"
        )


def completion(
    token_ids: Sequence[int] | np.ndarray,
    logprobs: Sequence[float] | np.ndarray,
    finish_reason: str,
    spans: Sequence[tuple[int, int, int]],
    version: int,
    forced_positions: Sequence[int] = (),
) -> m.Completion:
    """The record a backend returns for one sample.

    Args:
        token_ids: [L] sampled ids; logprobs: [L] their log-probs (natural log).
        finish_reason: "stop" (EOS or a stop token) or "length" (hit max_new_tokens; the last
            token is the one sampled there, with its log-prob).
        spans: (version, start, end) triples covering [0, L), oldest first; more than one when
            a weight update happened while the sample was generated.
        version: the version served when the request started; the stamps when there are no
            spans (L = 0).
        forced_positions: indices of tokens written without sampling them (JAX engine's
            end-of-think phrase); empty for vLLM.

    The stamps are the first and last span's versions; the spans travel as they are.
    """
    spans = tuple((int(v), int(a), int(b)) for v, a, b in spans)
    v0, v1 = (spans[0][0], spans[-1][0]) if spans else (version, version)
    return m.Completion(
        token_ids=np.asarray(token_ids, np.int32),
        logprobs=np.asarray(logprobs, np.float32),
        finish_reason=finish_reason,
        version_start=v0,
        version_end=v1,
        version_spans=spans,
        forced_positions=tuple(forced_positions),
    )


def group_of(
    prompt: m.Prompt, completions: Sequence[m.Completion], generation_s: float
) -> m.RolloutGroup:
    """The `RolloutGroup` returned for `prompt`: its G completions in sample order, each stamped
    with `generation_s` (seconds from the engine taking the prompt to the group's end).

    Raises:
        ValueError: the backend returned not exactly G completions.
    """
    if len(completions) != prompt.group_size:
        raise ValueError(
            f"prompt {prompt.sample_id!r}: expected {prompt.group_size} samples of it, the "
            f"backend returned {len(completions)}"
        )
    stamped = tuple(dataclasses.replace(c, generation_s=generation_s) for c in completions)
    return m.RolloutGroup(sample_id=prompt.sample_id, completions=stamped)


def aborted_group(prompt: m.Prompt, version: int) -> m.RolloutGroup:
    """G empty completions with finish reason "abort": a prompt this engine cannot serve
    (too long, sampling it refuses). Returned, not released, so that it does not circle
    through the queue forever; the trainer drops aborted groups."""
    empty = completion((), (), "abort", (), version)
    return m.RolloutGroup(sample_id=prompt.sample_id, completions=(empty,) * prompt.group_size)


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
        self, prompt: m.Prompt, stop_strings: Sequence[str] = ()
    ) -> tuple[m.Completion, ...]:
        """Sample `prompt.group_size` completions of one prompt under `prompt.sampling`, in
        sample order (see `completion`); many calls may run at once.

        Args:
            stop_strings: text that ends a completion (an environment's tool-call closing
                tag, `envs.base.Environment.stop_strings`), kept in it, finish reason "stop".
                A backend that cannot end on text inside its engine (the JAX engine) samples
                on; its caller cuts the record (`rollout_engine.episode.cut_at_stop`).

        Raises:
            ValueError: an empty prompt, a prompt plus `max_new_tokens` over the context, or
                sampling settings this engine cannot serve.
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
    def tokenizer_path(self) -> str | None:
        """The HF folder whose tokenizer and chat template the served model uses (multi-turn
        episodes tokenize observations with it): the backend config's `model`, or None."""
        model = getattr(getattr(self, "cfg", None), "model", None)
        return str(model) if model else None

    @property
    @abstractmethod
    def weight_version(self) -> int | None:
        """The version served now, or None while no whole version is held."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and release its resources."""
