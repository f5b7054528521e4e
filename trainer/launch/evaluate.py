"""Held-out accuracy through the run's own engines: eval prompts via the gateway.

Eval prompts (``is_eval=True``, leased before training prompts) are submitted with sample ids
``eval/<tag>/<index>`` and ``min_version`` = the version to evaluate, fetched, and scored by the
training verifiers. It runs while the trainer's `RolloutSource` is stopped (before and after
training), so it also takes the training groups still in flight at the stop: it counts them
(`drained`) and, given `expect_drained`, waits until that many came back, which proves no
rollout was lost.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from gateway import messages as m
from gateway.client import GatewayClient
from trainer.rewards.base import Problem
from trainer.rewards.scoring import ScoringPool
from trainer.rollout_source import group_from_gateway
from trainer.rollouts import RolloutGroup


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """One evaluation.

    Attributes:
      tag: "before" or "after". version: the weight version evaluated (engines at >= it).
      accuracy: mean reward over problems x samples, in [0, 1] for 0/1 verifiers.
      problems, samples: held-out problems and completions per problem.
      drained: training groups (not eval) fetched meanwhile. seconds: wall time.
    """

    tag: str
    version: int
    accuracy: float
    problems: int
    samples: int
    drained: int
    seconds: float


def evaluate(
    client: GatewayClient,
    problems: Sequence[Problem],
    encode: Callable[[Problem], Sequence[int]],
    scoring: ScoringPool,
    sampling: m.SamplingParams,
    *,
    samples: int,
    version: int,
    tag: str,
    timeout_s: float,
    expect_drained: int = 0,
    out_dir: Path | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Evaluate `problems` at weight `version`; writes ``out_dir/eval_<tag>.jsonl`` (one line per
    problem: id, rewards, completions decoded by `decode`) when `out_dir` is given.
    `on_progress(back, total)` is called with the eval groups back so far: once at the start
    (0) and after every fetch that brought some (a progress bar).

    Raises:
      ValueError: no problems; TimeoutError: the groups (or `expect_drained` training groups)
        did not all come back within `timeout_s`; GatewayError: the gateway refused the prompts.
    """
    if not problems:
        raise ValueError("evaluate needs at least one held-out problem")
    t0 = time.monotonic()
    by_id = {f"eval/{tag}/{i}": p for i, p in enumerate(problems)}
    prompts = [
        m.Prompt(
            sample_id=sid,
            token_ids=np.asarray(encode(p), np.int32),
            group_size=samples,
            sampling=sampling,
            is_eval=True,
            min_version=version,
        )
        for sid, p in by_id.items()
    ]
    client.submit_prompts(prompts)
    futures: dict[str, Future[RolloutGroup]] = {}
    if on_progress is not None:
        on_progress(0, len(prompts))
    drained = 0
    while len(futures) < len(prompts) or drained < expect_drained:
        left = t0 + timeout_s - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"eval {tag!r}: {len(futures)}/{len(prompts)} groups and {drained}/"
                f"{expect_drained} in-flight training groups back within {timeout_s} s"
            )
        for raw in client.fetch_rollouts(64, timeout_s=min(1.0, left)):
            problem = by_id.get(raw.sample_id)
            if problem is None:
                drained += 1
            else:
                futures[raw.sample_id] = scoring.score_async(group_from_gateway(raw), problem)
                if on_progress is not None:
                    on_progress(len(futures), len(prompts))
    rows = []
    for sid, future in sorted(futures.items(), key=lambda kv: int(kv[0].rsplit("/", 1)[1])):
        group = future.result(timeout=timeout_s)
        rows.append((sid, by_id[sid], group))
    rewards = np.array([r for _, _, g in rows for r in g.rewards], np.float64)
    if out_dir is not None:
        with (Path(out_dir) / f"eval_{tag}.jsonl").open("w") as f:
            for sid, problem, group in rows:
                texts = [decode(list(c.token_ids)) if decode else None for c in group.completions]
                line = {
                    "sample_id": sid,
                    "problem_id": problem.problem_id,
                    "answer": problem.answer,
                    "rewards": group.rewards,
                    "completions": texts,
                }
                f.write(json.dumps(line) + "\n")
    return EvalResult(
        tag=tag,
        version=version,
        accuracy=float(rewards.mean()),
        problems=len(prompts),
        samples=samples,
        drained=drained,
        seconds=time.monotonic() - t0,
    )


def drain_training_groups(client: GatewayClient, expected: int, timeout_s: float) -> int:
    """Fetch (and discard) the `expected` training groups still in flight after a stop; returns
    how many came.

    Raises:
      TimeoutError: fewer than `expected` came within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    got = 0
    while got < expected:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{got}/{expected} in-flight training groups back in {timeout_s} s")
        got += len(client.fetch_rollouts(64, timeout_s=min(1.0, left)))
    return got
