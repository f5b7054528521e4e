"""Held-out accuracy through the run's own engines: eval prompts via the gateway.

Eval prompts (``is_eval=True``, leased before training prompts) are submitted with sample ids
``eval/<tag>/<index>`` and ``min_version`` = the version to evaluate, fetched, and scored by the
training verifiers. It runs while the trainer's `RolloutSource` is stopped (before and after
training), so it also takes the training groups still in flight at the stop: it counts them
(`drained`) and, given `expect_drained`, waits until that many came back, which proves no
rollout was lost. Between training updates (eval.every, `trainer.launch.eval_every`) the
trainer's fetching thread is paused instead and the training groups fetched meanwhile are handed
to `on_training_group` (the `RolloutSource`), so none is lost or fetched twice. A group of
another evaluation (one that failed and left its prompts behind) is dropped and counted.

Both waits fail on silence, not on slowness (`trainer.launch.silence`): only when no group came
back for `timeout_s` seconds (eval.timeout_s), however long the whole evaluation takes; the
error says how many groups came, from which engines, and what each engine was doing.
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
from trainer.data.problem import Problem
from trainer.episodes import EpisodeSetup
from trainer.launch.silence import SilenceClock
from trainer.rewards.base import final_turn
from trainer.rewards.scoring import ScoringPool
from trainer.rollout_source import group_from_gateway, prompt_of
from trainer.rollouts import RolloutGroup


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """One evaluation.

    Attributes:
      tag: "before" or "after". version: the weight version evaluated (engines at >= it).
      accuracy: mean reward over problems x samples, in [0, 1] for 0/1 verifiers.
      problems, samples: held-out problems and completions per problem.
      drained: training groups (not eval) fetched meanwhile. seconds: wall time.
      metrics: `trainer.eval.metrics.summarize` of the samples (pass@1, pass@k, maj@k for k in
        1, 2, 4 .. samples, mean_length in tokens, length_cut_fraction); maj@k votes over the
        answers math-verify extracts from the decoded completions (empty without a decoder).
      stale: groups of another evaluation fetched meanwhile (dropped).
    """

    tag: str
    version: int
    accuracy: float
    problems: int
    samples: int
    drained: int
    seconds: float
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    stale: int = 0


def gather_eval_groups(
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
    on_progress: Callable[[int, int], None] | None = None,
    timeout_key: str = "eval.timeout_s",
    on_training_group: Callable[[m.RolloutGroup], None] | None = None,
    stale: list[int] | None = None,
    episodes: EpisodeSetup | None = None,
) -> tuple[list[tuple[Problem, RolloutGroup]], int]:
    """Submit `problems` as eval prompts at weight `version` (`samples` completions each), and
    return the scored groups in problem order with the count of training groups fetched
    meanwhile. `on_progress(back, total)` is called with the eval groups back so far: once at
    the start (0) and after every fetch that brought some (a progress bar).

    Args:
      timeout_s: seconds of silence (no group back, eval or training) after which the wait
        fails; the whole evaluation may take any time while groups keep coming.
      timeout_key: the config key of `timeout_s`, named in the error.
      on_training_group: given, each training group fetched meanwhile is handed to it (and
        counted) instead of dropped.
      stale: given, its first item grows by the groups of other evaluations fetched (dropped).
      episodes: given, each prompt is played as episodes of this environment (as in training).

    Raises:
      ValueError: no problems; TimeoutError: no group (nor any of the `expect_drained`
        training groups) came back for `timeout_s` seconds before all did (the message counts
        what came, from which engines, and names `timeout_key`); GatewayError: the gateway
        refused the prompts; what the verifier raised.
    """
    if not problems:
        raise ValueError("evaluate needs at least one held-out problem")
    by_id = {f"eval/{tag}/{i}": p for i, p in enumerate(problems)}
    prompts = [
        prompt_of(sid, p, encode, samples, sampling, episodes, is_eval=True, min_version=version)
        for sid, p in by_id.items()
    ]
    client.submit_prompts(prompts)
    futures: dict[str, Future[RolloutGroup]] = {}
    if on_progress is not None:
        on_progress(0, len(prompts))
    drained = 0
    clock = SilenceClock(timeout_s, timeout_key)
    while len(futures) < len(prompts) or drained < expect_drained:
        left = clock.left()
        if left <= 0:
            raise clock.expired(
                f"eval {tag!r} at version {version}: {len(futures)}/{len(prompts)} eval groups "
                f"and {drained}/{expect_drained} in-flight training groups back",
                client.status(),
            )
        for raw in client.fetch_rollouts(64, timeout_s=min(1.0, left)):
            clock.progressed(raw.engine_id)
            problem = by_id.get(raw.sample_id)
            if problem is None and raw.prompt is not None and raw.prompt.is_eval:
                if stale is not None:
                    stale[0] += 1  # left behind by an evaluation that failed
            elif problem is None:
                drained += 1
                if on_training_group is not None:
                    on_training_group(raw)
            else:
                futures[raw.sample_id] = scoring.score_async(group_from_gateway(raw), problem)
                if on_progress is not None:
                    on_progress(len(futures), len(prompts))
    rows = [(by_id[sid], futures[sid].result(timeout=timeout_s)) for sid in by_id]
    return rows, drained


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
    timeout_key: str = "eval.timeout_s",
    on_training_group: Callable[[m.RolloutGroup], None] | None = None,
    episodes: EpisodeSetup | None = None,
) -> EvalResult:
    """Evaluate `problems` at weight `version` (`gather_eval_groups`, whose arguments these
    are); writes ``out_dir/eval_<tag>.jsonl`` (one line per problem: id, rewards, completions
    decoded by `decode`) when `out_dir` is given.

    Raises:
      as `gather_eval_groups`.
    """
    t0 = time.monotonic()
    stale = [0]
    rows, drained = gather_eval_groups(
        client, problems, encode, scoring, sampling, samples=samples, version=version, tag=tag,
        timeout_s=timeout_s, expect_drained=expect_drained, on_progress=on_progress,
        timeout_key=timeout_key, on_training_group=on_training_group, stale=stale,
        episodes=episodes,
    )  # fmt: skip
    rewards = np.array([r for _, g in rows for r in g.rewards], np.float64)
    texts_of = [
        [decode(list(c.token_ids)) if decode else None for c in group.completions]
        for _, group in rows
    ]
    answers_of = [  # an episode's answer is its last model turn (not a tool result's number)
        [decode(final_turn(c).tolist()) if decode and c.turns else t
         for c, t in zip(group.completions, texts, strict=True)]
        for (_, group), texts in zip(rows, texts_of, strict=True)
    ]  # fmt: skip
    if out_dir is not None:
        with (Path(out_dir) / f"eval_{tag}.jsonl").open("w") as f:
            for (problem, group), texts in zip(rows, texts_of, strict=True):
                line = {
                    "sample_id": group.sample_id,
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
        problems=len(rows),
        samples=samples,
        drained=drained,
        seconds=time.monotonic() - t0,
        metrics=_sample_metrics([g for _, g in rows], answers_of),
        stale=stale[0],
    )


def _sample_metrics(
    groups: Sequence[RolloutGroup], texts: Sequence[Sequence[str | None]]
) -> dict[str, float]:
    """`summarize` over scored groups; answers for maj@k extracted (math-verify) from `texts`
    (None texts: no answer)."""
    from trainer.eval.metrics import ProblemSamples, summarize
    from trainer.eval.rows import canonical_answer
    from trainer.rewards.math_verifier import MathVerifier

    extract = MathVerifier().extract
    samples = [
        ProblemSamples(
            scores=g.rewards,
            answers=[None if t is None else canonical_answer(extract(t)) for t in ts],
            lengths=[len(c.token_ids) for c in g.completions],
            cut=[c.finish_reason == "length" for c in g.completions],
        )
        for g, ts in zip(groups, texts, strict=True)
    ]
    out = summarize(samples)
    return {k: float(v) for k, v in out.items() if k not in ("problems", "samples")}


def drain_training_groups(
    client: GatewayClient, expected: int, timeout_s: float, timeout_key: str = "eval.timeout_s"
) -> int:
    """Fetch (and discard) the `expected` training groups still in flight after a stop; returns
    how many came.

    Args:
      timeout_s: seconds of silence (no group back) after which the wait fails.
      timeout_key: the config key of `timeout_s`, named in the error.

    Raises:
      TimeoutError: no group came for `timeout_s` seconds before `expected` did (the message
        counts them, says from which engines, and names `timeout_key`).
    """
    clock = SilenceClock(timeout_s, timeout_key)
    got = 0
    while got < expected:
        left = clock.left()
        if left <= 0:
            raise clock.expired(
                f"drain after the stop: {got}/{expected} in-flight training groups back",
                client.status(),
            )
        for raw in client.fetch_rollouts(min(64, expected - got), timeout_s=min(1.0, left)):
            clock.progressed(raw.engine_id)
            got += 1
    return got
