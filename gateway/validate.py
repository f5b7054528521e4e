"""Field checks on incoming messages; each failure names what was expected and what came.

Every function raises `GatewayError` with code INVALID_ARGUMENT and returns nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from gateway.errors import invalid, shown
from gateway.routes import check_routes
from protos import rollout_pb2 as rpb

_LOGPROB_SLACK = 1e-4  # a log-probability may exceed 0 by float rounding only


def check_timeout(name: str, value: float) -> None:
    """A timeout must be finite and >= 0 seconds."""
    if not (math.isfinite(value) and value >= 0):
        raise invalid(f"{name}: expected a finite number of seconds >= 0, got {value}")


def check_id(name: str, value: str) -> None:
    """An id must be a non-empty string."""
    if not value:
        raise invalid(f"{name}: expected a non-empty id, got ''")


def check_prompt(
    prompt: rpb.Prompt,
    max_group_size: int,
    max_prompt_tokens: int,
    max_new_tokens: int = 1 << 20,
    max_turns: int = 64,
) -> None:
    """Check one submitted prompt: id, tokens [P] (1 <= P <= max), G, sampling parameters
    (1 <= max_new_tokens <= `max_new_tokens`), and its episode if it has one
    (`check_episode`)."""
    where = f"prompt {shown(prompt.sample_id)}"
    check_id("sample_id", prompt.sample_id)
    n = len(prompt.token_ids)
    if not 1 <= n <= max_prompt_tokens:
        raise invalid(f"{where}: expected 1..{max_prompt_tokens} prompt tokens, got {n}")
    if min(prompt.token_ids) < 0:
        raise invalid(f"{where}: expected token ids >= 0, got {min(prompt.token_ids)}")
    if not 1 <= prompt.group_size <= max_group_size:
        raise invalid(f"{where}: expected group size 1..{max_group_size}, got {prompt.group_size}")
    if prompt.min_version < 0:
        raise invalid(f"{where}: expected min_version >= 0, got {prompt.min_version}")
    s = prompt.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise invalid(f"{where}: expected temperature >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise invalid(f"{where}: expected 0 < top_p <= 1, got {s.top_p}")
    if s.top_k < 0:
        raise invalid(f"{where}: expected top_k >= 0 (0: no cut), got {s.top_k}")
    if not 1 <= s.max_new_tokens <= max_new_tokens:
        raise invalid(
            f"{where}: expected max_new_tokens 1..{max_new_tokens}, got {s.max_new_tokens}"
        )
    if s.stop_token_ids and min(s.stop_token_ids) < 0:
        raise invalid(f"{where}: expected stop token ids >= 0, got {min(s.stop_token_ids)}")
    if s.reasoning_budget < 0:
        raise invalid(f"{where}: expected reasoning_budget >= 0, got {s.reasoning_budget}")
    if prompt.HasField("episode"):
        check_episode(where, prompt.episode, max_new_tokens, max_turns)


def check_episode(where: str, e: rpb.Episode, max_tokens: int, max_turns: int) -> None:
    """A multi-turn episode: an environment name, 1 <= max_turns <= `max_turns`,
    1 <= max_tokens <= `max_tokens` (the longest completion), max_observation_chars >= 1
    (the task's size is a field bound, `gateway.bounds`; its JSON is the engine's to read)."""
    if not e.env:
        raise invalid(f"{where}: expected an episode's environment name, got ''")
    if not 1 <= e.max_turns <= max_turns:
        raise invalid(f"{where}: expected episode max_turns 1..{max_turns}, got {e.max_turns}")
    if not 1 <= e.max_tokens <= max_tokens:
        raise invalid(f"{where}: expected episode max_tokens 1..{max_tokens}, got {e.max_tokens}")
    if e.max_observation_chars < 1:
        raise invalid(
            f"{where}: expected episode max_observation_chars >= 1, got {e.max_observation_chars}"
        )


def check_min_version(prompts: Iterable[rpb.Prompt], current_version: int, ahead: int) -> None:
    """Refuse a prompt no engine can lease soon: `min_version` > current version + `ahead`.

    The trainer publishes a version before it submits prompts for it (or, with `ahead` >= 1,
    while it pushes it), so a larger `min_version` is a mistake that would leave the prompt
    pending until that many more versions are published.
    """
    top = current_version + ahead
    for p in prompts:
        if p.min_version > top:
            raise invalid(
                f"prompt {shown(p.sample_id)}: expected min_version <= {top} (the current "
                f"version {current_version} + min_version_ahead {ahead}), got {p.min_version}"
            )


def check_completion(
    where: str, completion: rpb.Completion, max_new_tokens: int, current_version: int
) -> None:
    """Check one returned completion: tokens [L], log-probs [L], finish reason, versions (its
    routed experts need the prompt: `check_group`)."""
    n = len(completion.token_ids)
    if len(completion.logprobs) != n:
        raise invalid(
            f"{where}: expected one log-prob per token ({n}), got {len(completion.logprobs)}"
        )
    if n > max_new_tokens:
        raise invalid(f"{where}: expected at most max_new_tokens={max_new_tokens}, got {n}")
    if n:  # numpy reads the repeated fields through the buffer protocol, far faster than a loop
        ids, lps = np.asarray(completion.token_ids), np.asarray(completion.logprobs)
        if ids.min() < 0:
            raise invalid(f"{where}: expected token ids >= 0, got {ids.min()}")
        if not np.isfinite(lps).all():
            bad = lps[~np.isfinite(lps)][0]
            raise invalid(f"{where}: expected finite log-probs, got {bad}")
        if lps.max() > _LOGPROB_SLACK:
            raise invalid(f"{where}: expected log-probs <= 0, got {lps.max()}")
    if completion.finish_reason == rpb.FINISH_REASON_UNSPECIFIED:
        raise invalid(f"{where}: expected a finish reason (STOP, LENGTH or ABORT), got none")
    if completion.finish_reason not in rpb.FinishReason.values():
        raise invalid(f"{where}: expected a known finish reason, got {completion.finish_reason}")
    v0, v1 = completion.version_start, completion.version_end
    if not 0 <= v0 <= v1 <= current_version:
        raise invalid(
            f"{where}: expected 0 <= version_start <= version_end <= {current_version} "
            f"(the current version), got {v0} and {v1}"
        )
    forced = list(completion.forced_positions)
    if len(forced) > n or any(not 0 <= j < n for j in forced) or forced != sorted(set(forced)):
        raise invalid(
            f"{where}: expected forced_positions ascending, unique and in [0, {n}), got "
            f"{len(forced)} positions starting {forced[:4]}"
        )
    t, o = completion.turns, completion.observations
    if t < 0 or not 0 <= o <= max(t - 1, 0):
        raise invalid(
            f"{where}: expected turns >= 0 and 0 <= observations < turns, got {t} turns and "
            f"{o} observations"
        )
    if completion.HasField("env_reward") and not math.isfinite(completion.env_reward):
        raise invalid(f"{where}: expected a finite env_reward, got {completion.env_reward}")
    for span in completion.version_spans:
        if not (v0 <= span.version <= v1 and 0 <= span.start_token <= span.end_token <= n):
            raise invalid(
                f"{where}: expected version spans within versions [{v0}, {v1}] and tokens "
                f"[0, {n}], got version {span.version} tokens "
                f"[{span.start_token}, {span.end_token})"
            )


def check_group(group: rpb.RolloutGroup, prompt: rpb.Prompt, current_version: int) -> None:
    """Check a returned group against its prompt: exactly G valid completions, each with
    routed experts of prompt + completion - 1 rows when it has any
    (`gateway.routes.check_routes`)."""
    where = f"group {shown(group.sample_id)}"
    g = prompt.group_size
    if len(group.completions) != g:
        raise invalid(
            f"{where}: expected {g} completions (the group size), got {len(group.completions)}"
        )
    longest = (
        prompt.episode.max_tokens if prompt.HasField("episode") else prompt.sampling.max_new_tokens
    )
    p = len(prompt.token_ids)
    for i, c in enumerate(group.completions):
        check_completion(f"{where} completion {i}", c, longest, current_version)
        rows = p + len(c.token_ids) - 1
        check_routes(
            f"{where} completion {i}", c.routed_experts, rows, c.routed_layers, c.routed_k,
            c.routed_id_bytes,
        )  # fmt: skip
