"""Stop rules of one decode step: EOS, the length limit, forced end of thinking.

Legend: B batch (rows), M length of the end-of-think marker.

All functions are pure and shape-static so they run inside the compiled decode step. A row's
``gen_len`` is the number of completion tokens it emitted before the token being decided now, so
the token decided now is completion token number ``gen_len + 1`` (1-based). The rules, after the
seed write-up "Async RL in Pure JAX" (``_maybe_force_eot`` then ``_maybe_force_eos``), with three
changes: several EOS ids; at the length limit the sampled token is kept with its log-prob and the
sample ends with reason "length", as vLLM does (the seed swaps it for a forced EOS with log-prob
0, a token the policy never sampled that the loss would then train on); the end-of-think marker
may span several tokens and is matched on the emitted tokens.

The only tokens an engine writes without sampling them are those of the end-of-think phrase at a
reasoning budget. `StepDecision.forced` marks them; they travel to the trainer as
``Completion.forced_positions`` and are masked out of the loss (`trainer.batch.build_rl_batch`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

RUNNING, STOP_EOS, STOP_LENGTH = 0, 1, 2
"""Finish reasons stored per row: still running, the model emitted an EOS, the length limit."""


@dataclasses.dataclass(frozen=True)
class StopConfig:
    """Static stop settings (hashable; part of the compiled decode step's signature).

    Attributes:
        eos_ids: token ids that end a sample.
        pad_id: token written (with log-prob 0) for rows that already finished.
        think_phrase: token ids inserted so that the phrase's last token is completion token number
            ``think_budget``; empty means no reasoning budget.
        think_budget: completion tokens allowed for thinking, phrase included; ``None`` is off.
        think_marker: the tokens that end thinking (a suffix of ``think_phrase`` occurring nowhere
            else in it); defaults to the phrase's last token. A row whose emitted tokens end with
            the marker before the phrase would start is left alone.
    """

    eos_ids: tuple[int, ...]
    pad_id: int = 0
    think_phrase: tuple[int, ...] = ()
    think_budget: int | None = None
    think_marker: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.eos_ids:
            raise ValueError("eos_ids must hold at least one token id, got ()")
        if (self.think_budget is None) != (len(self.think_phrase) == 0):
            raise ValueError(
                "think_budget and think_phrase go together: got budget "
                f"{self.think_budget} with a phrase of {len(self.think_phrase)} tokens"
            )
        if self.think_budget is None:
            return
        if self.think_budget < len(self.think_phrase):
            raise ValueError(
                f"think_budget ({self.think_budget}) must be >= the phrase length "
                f"({len(self.think_phrase)}) so that the whole phrase fits"
            )
        marker = self.think_marker or self.think_phrase[-1:]
        n = len(marker)
        if tuple(self.think_phrase[-n:]) != tuple(marker):
            raise ValueError(f"think_marker {marker} must be a suffix of {self.think_phrase}")
        phrase = tuple(self.think_phrase)
        if any(phrase[i : i + n] == tuple(marker) for i in range(len(phrase) - n)):
            raise ValueError(f"think_marker {marker} occurs inside {phrase} before its end")
        object.__setattr__(self, "think_marker", tuple(marker))

    @property
    def has_budget(self) -> bool:
        """True when a reasoning budget is set."""
        return self.think_budget is not None

    @property
    def marker_len(self) -> int:
        """M: the number of tokens of the end-of-think marker (1 when no budget is set)."""
        return max(len(self.think_marker), 1)


class StepDecision(NamedTuple):
    """What one decode step emits per row (all ``[B]`` except ``history``)."""

    tokens: jax.Array  # [B] int32, the token written to the output and fed next
    logprobs: jax.Array  # [B] float32, 0 where the token was forced or the row was finished
    reason: jax.Array  # [B] int32 in {RUNNING, STOP_EOS, STOP_LENGTH}
    think_done: jax.Array  # [B] bool, thinking has ended (by the model or by the phrase)
    history: jax.Array  # [B, M] int32, the last M emitted tokens, oldest first
    forced: jax.Array  # [B] bool, the engine wrote the token without sampling it (think phrase)


def eos_mask(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """``[B]`` bool: whether each token is one of ``eos_ids``. ``tokens``: ``[B]`` int."""
    return jnp.isin(tokens, jnp.asarray(eos_ids, dtype=tokens.dtype))


def force_end_of_think(
    tokens: jax.Array,
    logprobs: jax.Array,
    gen_len: jax.Array,
    think_done: jax.Array,
    *,
    phrase: tuple[int, ...],
    budget: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Overwrite the token with the phrase token due at this position, for rows still thinking.

    Phrase token ``t`` (0-based, ``L = len(phrase)``) goes where ``gen_len == budget - L + t``, so
    the last one is completion token number ``budget``. Rows with ``think_done`` keep their token.

    Args:
        tokens, logprobs: ``[B]`` int32 / float32, the sampled tokens and their log-probs.
        gen_len: ``[B]`` int32, completion tokens emitted before this one.
        think_done: ``[B]`` bool, thinking already ended before this step.

    Returns:
        ``(tokens, logprobs, forced)``: forced entries with log-prob 0, and ``forced`` ``[B]`` bool
        marking them (they are masked out of the loss).
    """
    offset = gen_len - (budget - len(phrase))  # [B] index into the phrase when in [0, L)
    in_window = (offset >= 0) & (offset < len(phrase)) & ~think_done
    phrase_arr = jnp.asarray(phrase, dtype=jnp.int32)
    forced = phrase_arr[jnp.clip(offset, 0, len(phrase) - 1)]
    tokens = jnp.where(in_window, forced, tokens)
    logprobs = jnp.where(in_window, jnp.float32(0.0), logprobs)
    return tokens, logprobs, in_window


def decide(
    tokens: jax.Array,
    logprobs: jax.Array,
    *,
    gen_len: jax.Array,
    max_new: jax.Array,
    finished: jax.Array,
    think_done: jax.Array,
    history: jax.Array,
    cfg: StopConfig,
) -> StepDecision:
    """Apply every stop rule to the sampled tokens of one step.

    Order: rows already ``finished`` emit ``pad_id`` with log-prob 0 and keep their state; then the
    end-of-think phrase (forced tokens, log-prob 0, ``forced`` set); then EOS; then the length
    limit: completion token number ``max_new`` ends the row with reason ``STOP_LENGTH`` and keeps
    the token and log-prob it has (sampled, or forced by the phrase), unless it is an EOS (then
    the reason is EOS). No token is ever replaced at the limit.

    Args:
        tokens: ``[B]`` int32 sampled tokens; logprobs: ``[B]`` float32 their log-probs.
        gen_len: ``[B]`` int32 completion tokens emitted before this one.
        max_new: ``[B]`` int32 completion tokens allowed per row (``>= 1``).
        finished: ``[B]`` bool rows that finished at an earlier step.
        think_done: ``[B]`` bool; history: ``[B, M]`` int32 last emitted tokens (``M =
            cfg.marker_len``; initialise with ``-1``).
        cfg: the static stop settings.

    Returns:
        The :class:`StepDecision`; ``reason`` is ``RUNNING`` for rows that go on and for rows that
        were already ``finished`` (their reason was reported when they finished).
    """
    if history.shape != (tokens.shape[0], cfg.marker_len):
        raise ValueError(
            f"history must be [B, M] = {(tokens.shape[0], cfg.marker_len)}, got {history.shape}"
        )
    tokens = tokens.astype(jnp.int32)
    logprobs = logprobs.astype(jnp.float32)
    forced = jnp.zeros(tokens.shape, bool)
    if cfg.has_budget:
        assert cfg.think_budget is not None
        tokens, logprobs, forced = force_end_of_think(
            tokens, logprobs, gen_len, think_done, phrase=cfg.think_phrase, budget=cfg.think_budget
        )
    is_eos = eos_mask(tokens, cfg.eos_ids)
    at_limit = gen_len + 1 >= max_new
    reason = jnp.where(is_eos, STOP_EOS, jnp.where(at_limit, STOP_LENGTH, RUNNING))

    tokens = jnp.where(finished, jnp.int32(cfg.pad_id), tokens)
    logprobs = jnp.where(finished, jnp.float32(0.0), logprobs)
    forced = forced & ~finished
    reason = jnp.where(finished, RUNNING, reason).astype(jnp.int32)

    new_history = jnp.concatenate([history[:, 1:], tokens[:, None]], axis=1)
    new_history = jnp.where(finished[:, None], history, new_history)
    if cfg.has_budget:
        marker = jnp.asarray(cfg.think_marker, dtype=jnp.int32)
        ended = jnp.all(new_history == marker[None, :], axis=1) & ~finished
        think_done = think_done | ended
    return StepDecision(tokens, logprobs, reason, think_done, new_history, forced)
