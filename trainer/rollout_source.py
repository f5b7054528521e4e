"""The trainer's end of the gateway: submit prompts ahead, fetch finished groups in a background
thread, score them in the scoring pool, and hand them to the training thread in arrival order.

Accounting: every submitted prompt is, at any moment, either consumed (its group trained or
filtered in an update the loop applied, see `RolloutSource.consume`) or in flight (queued or
leased at the gateway, waiting there, fetched and waiting here, or taken by an update that has
not been applied): ``submitted == consumed + in_flight``. Which problem positions were consumed
is kept in a `PositionLedger`, so a checkpoint resumes the data exactly.

Sample ids are ``"<position>:<problem id>"``, or ``"<position>@<attempt>:<problem id>"`` after
a resume (attempt = resumes so far), so a resumed trainer that joins a gateway still holding
the groups of its previous attempt never repeats an in-flight sample id; groups of an earlier
attempt that still arrive are dropped and counted (`stale_groups`).

The wait for groups measures silence: `next_group` fails only when no group arrived for its
timeout, however long the whole update takes, and its error says what was awaited, how many
groups arrived from which engines, and which engines the gateway has.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from gateway import messages as m
from gateway.client import GatewayClient
from trainer.data.problem import Problem
from trainer.data.problem_stream import ProblemStream
from trainer.episodes import EpisodeSetup
from trainer.positions import ConsumedPositions, PositionLedger
from trainer.rewards.scoring import ScoringPool
from trainer.rollouts import RolloutGroup

Encode = Callable[[Problem], Sequence[int]]


def sample_id_for(position: int, problem: Problem, attempt: int = 0) -> str:
    """The sample id of `position` in attempt `attempt` of a run (see the module docstring)."""
    head = f"{position}@{attempt}" if attempt else str(position)
    return f"{head}:{problem.problem_id}"


def attempt_of(sample_id: str) -> int:
    """The attempt a training sample id was submitted in (0 when it carries none)."""
    _, sep, tail = sample_id.partition(":")[0].partition("@")
    return int(tail) if sep and tail.isdigit() else 0


def prompt_of(
    sample_id: str,
    problem: Problem,
    encode: Encode,
    group_size: int,
    sampling: m.SamplingParams,
    episodes: EpisodeSetup | None = None,
    **fields: object,
) -> m.Prompt:
    """The prompt of `problem`: `encode`d question (the environment's first message and the
    `Episode` when `episodes` is given); `fields` are further `Prompt` fields (min_version,
    is_eval).

    Raises:
      ValueError: the environment refuses the problem's task.
    """
    if episodes is None:
        ids, episode = encode(problem), None
    else:
        ids, episode = encode(episodes.as_prompt_problem(problem)), episodes.episode_of(problem)
    return m.Prompt(
        sample_id=sample_id, token_ids=np.asarray(ids, np.int32), group_size=group_size,
        sampling=sampling, episode=episode, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def group_from_gateway(group: m.RolloutGroup) -> RolloutGroup:
    """A fetched gateway group (with its prompt attached) as the trainer's `RolloutGroup`.

    Raises:
      ValueError: if the gateway did not attach the prompt.
    """
    if group.prompt is None:
        raise ValueError(f"group {group.sample_id!r} came without its prompt")
    return RolloutGroup(group.sample_id, group.prompt.token_ids, group.completions, group.engine_id)


class RolloutSource:
    """Prompts out, scored groups in.

    Args:
      client: a trainer-role gateway client.
      problems: where prompts come from (`ProblemStream.at`: position -> problem).
      encode: problem -> prompt token ids (the chat template is the caller's business).
      scoring: the verifier thread pool.
      group_size: G completions per prompt.
      sampling: sampling parameters sent with every prompt; a problem with its own
        `Problem.max_new_tokens` gets that budget instead (at most ``sampling.max_new_tokens``).
      fetch_timeout_s: seconds one FetchRollouts call waits (also bounds `stop`).
      fetch_max_groups: most groups one fetch takes.
      score_timeout_s: most seconds the training thread waits for one group's verifier after
        the group arrived.
      ledger: consumed and in-flight positions (a resumed one from the checkpoint); None: a
        fresh ledger whose frontier is ``problems.position``.
      attempt: resumes of this run so far (tags sample ids, see the module docstring).
      episodes: given, every prompt is G multi-turn episodes of this environment
        (`trainer.episodes`): its token ids encode the environment's first message, and its
        `Episode` carries the task and bounds.
    """

    def __init__(
        self,
        client: GatewayClient,
        problems: ProblemStream,
        encode: Encode,
        scoring: ScoringPool,
        *,
        group_size: int,
        sampling: m.SamplingParams,
        fetch_timeout_s: float = 1.0,
        fetch_max_groups: int = 64,
        score_timeout_s: float = 60.0,
        ledger: PositionLedger | None = None,
        attempt: int = 0,
        episodes: EpisodeSetup | None = None,
    ):
        if group_size < 1 or fetch_timeout_s <= 0 or fetch_max_groups < 1 or attempt < 0:
            raise ValueError(
                "need group_size >= 1, fetch_timeout_s > 0, fetch_max_groups >= 1, attempt >= 0;"
                f" got {group_size}, {fetch_timeout_s}, {fetch_max_groups}, {attempt}"
            )
        self.client = client
        self.problems = problems
        self.encode = encode
        self.scoring = scoring
        self.group_size = group_size
        self.sampling = sampling
        self.fetch_timeout_s = fetch_timeout_s
        self.fetch_max_groups = fetch_max_groups
        self.score_timeout_s = score_timeout_s
        self.ledger = (
            ledger if ledger is not None else PositionLedger(ConsumedPositions(problems.position))
        )
        self.attempt = attempt
        self.episodes = episodes
        self.submitted = 0
        self.consumed = 0
        self.stale_groups = 0
        self.stale_eval_groups = 0
        self.arrived_from: Counter[str] = Counter()
        self._last_arrival = 0.0
        self._lock = threading.Lock()
        self._problem_of: dict[str, Problem] = {}
        self._position_of: dict[str, int] = {}
        self._taken: set[str] = set()
        self._ready: queue.Queue[Future[RolloutGroup]] = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def in_flight(self) -> int:
        """Submitted prompts not yet consumed."""
        return self.submitted - self.consumed

    @property
    def waiting_here(self) -> int:
        """Groups fetched (scored or being scored) that no applied update consumed: not taken
        yet, or taken by an update that was abandoned (a stop during its collection)."""
        return self._ready.qsize() + len(self._taken)

    def position_of(self, sample_id: str) -> int:
        """The problem position of a submitted, not yet consumed sample id.

        Raises:
          KeyError: an id this source does not hold.
        """
        return self._position_of[sample_id]

    def start(self) -> RolloutSource:
        """Start the fetching thread (again after a `stop`); returns self."""
        if self._thread is not None:
            raise RuntimeError("RolloutSource already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._collect, name="rollout-fetch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop fetching (within about fetch_timeout_s); groups already fetched stay counted."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _sampling_for(self, problem: Problem) -> m.SamplingParams:
        """The sampling of `problem`'s prompt: `sampling` with the problem's own budget."""
        if problem.max_new_tokens is None:
            return self.sampling
        budget = min(problem.max_new_tokens, self.sampling.max_new_tokens)
        return dataclasses.replace(self.sampling, max_new_tokens=budget)

    def top_up(self, target_in_flight: int, min_version: int) -> int:
        """Submit prompts until `target_in_flight` are in flight; each may only be generated by
        an engine holding weight version >= `min_version`. Returns how many were submitted.

        Raises:
          GatewayError: if the gateway refuses them (all or none are queued).
        """
        missing = target_in_flight - self.in_flight
        if missing <= 0:
            return 0
        positions = self.ledger.take(missing)
        batch = []
        for position in positions:
            problem = self.problems.at(position)
            batch.append((sample_id_for(position, problem, self.attempt), position, problem))
        prompts = [
            prompt_of(
                sid,
                problem,
                self.encode,
                self.group_size,
                self._sampling_for(problem),
                self.episodes,
                min_version=min_version,
            )  # fmt: skip
            for sid, _, problem in batch
        ]
        with self._lock:
            self._problem_of.update({sid: problem for sid, _, problem in batch})
            self._position_of.update({sid: position for sid, position, _ in batch})
        self.client.submit_prompts(prompts)
        self.submitted += len(prompts)
        return len(prompts)

    def next_group(
        self,
        timeout_s: float,
        *,
        waiting_for: str = "a rollout group",
        should_stop: Callable[[], bool] | None = None,
    ) -> RolloutGroup | None:
        """The next scored group (arrival order). Waits while groups keep arriving: fails only
        when none arrived (from any engine) for `timeout_s` seconds since the later of this
        call and the last arrival. Returns None as soon as `should_stop()` is true (polled every
        0.1 s). The group stays in flight until `consume` takes it.

        Raises:
          TimeoutError: the silence lasted `timeout_s` (the message names `waiting_for`, the
            groups that arrived per engine, and the engines the gateway has), or the group's
            scoring took over score_timeout_s.
          RuntimeError: the fetching thread failed (its error chained).
          Exception: what the verifier raised for this group.
        """
        started = time.monotonic()
        while True:
            if self._error is not None:
                raise RuntimeError("fetching rollouts failed") from self._error
            if should_stop is not None and should_stop():
                return None
            try:
                future = self._ready.get(timeout=0.1)
                break
            except queue.Empty:
                silent_s = time.monotonic() - max(started, self._last_arrival)
                if silent_s >= timeout_s:
                    raise TimeoutError(self._silence_message(waiting_for, timeout_s)) from None
        group = future.result(timeout=self.score_timeout_s)
        self._taken.add(group.sample_id)
        return group

    def consume(self, groups: Sequence[RolloutGroup]) -> list[int]:
        """Mark `groups` (taken by `next_group`) consumed: trained or filtered in an update that
        was applied. Returns their problem positions.

        Raises:
          KeyError: a group this source did not hand out, or one consumed already.
        """
        ids = [g.sample_id for g in groups]
        missing = [i for i in ids if i not in self._taken]
        if missing or len(set(ids)) != len(ids):
            wrong = missing or ids
            raise KeyError(f"groups {wrong[:4]} were not taken from this source (or consumed)")
        positions = [self._position_of[g.sample_id] for g in groups]
        self.ledger.consume(positions)
        for g in groups:
            self._taken.discard(g.sample_id)
            del self._position_of[g.sample_id]
        self.consumed += len(groups)
        return positions

    def _silence_message(self, waiting_for: str, timeout_s: float) -> str:
        arrived = sum(self.arrived_from.values())
        by_engine = ", ".join(f"{e or '?'}: {n}" for e, n in sorted(self.arrived_from.items()))
        try:
            engines = self.client.status().engines
            now = (
                "engines registered now: "
                + ", ".join(
                    f"{e.engine_id} (version {e.weight_version}, {e.leased_prompts} prompts "
                    f"leased, seen {e.last_seen_s:.1f} s ago)"
                    for e in engines
                )
                if engines
                else "no engine is registered at the gateway"
            )
        except Exception as err:  # the message must still come out
            now = f"the gateway's status failed too ({type(err).__name__}: {err})"
        return (
            f"waiting for {waiting_for}: no group arrived for {timeout_s} s "
            f"(rollout.rollout_timeout_s); {arrived} groups arrived in this run "
            f"({by_engine or 'from no engine'}), {self.in_flight} prompts in flight; {now}"
        )

    def _collect(self) -> None:
        try:
            while not self._stop.is_set():
                fetched = self.client.fetch_rollouts(
                    self.fetch_max_groups, timeout_s=self.fetch_timeout_s
                )
                for raw in fetched:
                    self.accept(raw)
        except BaseException as err:  # handed to the training thread by next_group
            self._error = err

    def accept(self, raw: m.RolloutGroup) -> None:
        """Take one fetched group: a training group of this attempt is scored and queued for
        `next_group`; one of an earlier attempt is dropped (`stale_groups`), and so is an eval
        group (`stale_eval_groups`: left behind by an evaluation that gave up on it). Called by
        the fetching thread, and by an evaluation that fetches while that thread is stopped
        (`trainer.launch.eval_every`).

        Raises:
          KeyError: a training group of this attempt that was never submitted (or came twice).
          ValueError: the gateway did not attach the prompt.
        """
        if raw.prompt is not None and raw.prompt.is_eval:
            self.stale_eval_groups += 1
            return
        group = group_from_gateway(raw)
        with self._lock:
            problem = self._problem_of.pop(group.sample_id, None)
        if problem is None:
            if attempt_of(group.sample_id) != self.attempt:
                self.stale_groups += 1  # a previous attempt's: redone here
                return
            raise KeyError(f"fetched group {group.sample_id!r} was never submitted")
        self.arrived_from[raw.engine_id] += 1
        self._last_arrival = time.monotonic()
        self._ready.put(self.scoring.score_async(group, problem))
