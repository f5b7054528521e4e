"""Requests, results and settings of the JAX engine (plain data; no JAX at import)."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Hashable

import numpy as np

from rollout_engine.jax.stop_strings import check_stop_strings

FINISH_REASONS = {1: "stop", 2: "length"}
"""Finish reason codes of ``stops`` as the strings the worker loop reports (vLLM's names)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to complete ``num_samples`` times.

    Attributes:
        prompt_id: identifies the prompt in the results; unique among requests in flight.
        prompt: the prompt token ids (at least one).
        num_samples: G, the completions wanted.
        max_new_tokens: completion tokens allowed per sample (the last one included).
        seed: seeds the samples' keys; defaults to a hash of ``prompt_id``. Sample g of a request
            draws the same tokens whatever slot, replica or batch it runs in.
        temperature, top_k, top_p: this request's sampling (0: greedy; top_k <= 0 and
            top_p >= 1: off); None: the engine's `SamplingConfig` value. Requests with
            different settings share the batch.
        continues: the prompt extends the tokens of an earlier sample on this engine (the
            next turn of a multi-turn episode: that turn's prompt and completion, then new
            tokens). With one sample, a replica whose free slot still holds a common prefix's
            KV cache at the current weight version continues there and prefills only the rest
            (`ContinuousBatcher`: slot memory); otherwise the prompt is prefilled whole.
        stop_strings: text that ends a sample, kept in it, finish reason "stop"
            (`rollout_engine.jax.stop_strings`: at most 16, each 1 to 256 characters); the
            batcher must have been given a ``decode`` function.
    """

    prompt_id: Hashable
    prompt: tuple[int, ...]
    num_samples: int = 1
    max_new_tokens: int = 128
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    continues: bool = False
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop_strings", check_stop_strings(self.stop_strings))
        if not self.prompt:
            raise ValueError(f"request {self.prompt_id!r}: the prompt is empty")
        if self.num_samples < 1:
            raise ValueError(
                f"request {self.prompt_id!r}: num_samples must be >= 1, got {self.num_samples}"
            )
        if self.temperature is not None and not self.temperature >= 0.0:
            raise ValueError(
                f"request {self.prompt_id!r}: temperature must be >= 0, got {self.temperature}"
            )
        if self.top_p is not None and not self.top_p > 0.0:
            raise ValueError(f"request {self.prompt_id!r}: top_p must be > 0, got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"request {self.prompt_id!r}: max_new_tokens must be >= 1, "
                f"got {self.max_new_tokens}"
            )

    @property
    def seed_value(self) -> int:
        """The 31-bit seed of this request's keys."""
        if self.seed is not None:
            return int(self.seed) & 0x7FFFFFFF
        return zlib.crc32(repr(self.prompt_id).encode()) & 0x7FFFFFFF


@dataclasses.dataclass
class SampleResult:
    """One completion.

    Attributes:
        prompt_id, sample_index: which request and which of its G samples.
        tokens: ``[n]`` int32 completion ids (the last is an EOS id, or the token sampled at the
            length limit). logprobs: ``[n]`` float32, each token's log-prob under the sampling
            distribution (0 for forced tokens).
        finish_reason: "stop" (the model emitted an EOS, or the text a stop string) or "length"
            (``max_new_tokens`` reached; the last token is the one sampled there, with its
            log-prob, as vLLM does).
        forced_positions: indices into ``tokens`` of the tokens the engine wrote without sampling
            them (the end-of-think phrase at a reasoning budget), ascending; kept out of the loss.
        weight_versions: ``(version, start, end)`` spans: tokens ``[start, end)`` were sampled
            with ``version`` (token 0 comes from the prefill). The KV cache of earlier tokens is
            kept across a switch, not recomputed.
        replica: index of the replica that produced it.
        routes: ``[P + n - 1, L, k]`` int32, the experts each MoE layer chose in each pass
            over the sample's tokens (row i: the pass over token i of prompt + completion,
            the prefill's then the decode steps'; routing replay), or None (a dense model, or
            a continued sample whose prompt was not prefilled whole).
    """

    prompt_id: Hashable
    sample_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    weight_versions: list[tuple[int, int, int]]
    replica: int = 0
    forced_positions: tuple[int, ...] = ()
    routes: np.ndarray | None = None

    @property
    def versions(self) -> tuple[int, ...]:
        """The distinct weight versions the sample saw, in order."""
        return tuple(dict.fromkeys(v for v, _, _ in self.weight_versions))
