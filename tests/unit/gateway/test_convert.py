"""Client dataclasses survive the trip through the protos exactly; bad values are refused."""

import dataclasses

import numpy as np
import pytest

from gateway import convert as cv
from gateway import messages as m
from gateway.config import GatewayConfig


def test_prompt_round_trip_keeps_every_field():
    for seed in (None, 0, 12345):
        p = m.Prompt(
            "s-1",
            np.array([5, 0, 70000], np.int32),
            4,
            m.SamplingParams(0.7, 0.95, 20, 128, (2, 7), seed, 64),
            is_eval=True,
            min_version=3,
        )
        back = cv.prompt_from_pb(cv.prompt_to_pb(p))
        assert back.token_ids.dtype == np.int32 and back.token_ids.tolist() == [5, 0, 70000]
        assert back.sampling.seed == seed
        assert back.sampling.temperature == pytest.approx(0.7, abs=1e-7)  # float32 on the wire
        assert (back.sampling.top_k, back.sampling.max_new_tokens) == (20, 128)
        assert (back.sampling.stop_token_ids, back.sampling.reasoning_budget) == ((2, 7), 64)
        assert (back.sample_id, back.group_size, back.is_eval, back.min_version) == (
            "s-1",
            4,
            True,
            3,
        )


def test_completion_round_trip_is_exact_in_float32():
    lps = np.array([-0.1, -2.5, -1e-8, -30.25], np.float32)
    c = m.Completion(np.array([1, 2, 3, 4], np.int32), lps, "abort", 2, 3, ((2, 0, 1), (3, 1, 4)),
                     0.5, 1.25)  # fmt: skip
    back = cv.completion_from_pb(cv.completion_to_pb(c))
    assert back.logprobs.dtype == np.float32 and back.logprobs.tobytes() == lps.tobytes()
    assert back.token_ids.tolist() == [1, 2, 3, 4]
    assert (back.finish_reason, back.version_start, back.version_end) == ("abort", 2, 3)
    assert back.version_spans == ((2, 0, 1), (3, 1, 4))
    assert (back.first_token_s, back.generation_s) == (0.5, 1.25)
    assert back.forced_positions == ()
    forced = dataclasses.replace(c, forced_positions=(1, 2))
    assert cv.completion_from_pb(cv.completion_to_pb(forced)).forced_positions == (1, 2)
    assert (back.turns, back.observations, back.env_reward) == (0, 0, None)
    episode = dataclasses.replace(c, turns=3, observations=2, env_reward=0.0)
    again = cv.completion_from_pb(cv.completion_to_pb(episode))
    assert (again.turns, again.observations, again.env_reward) == (3, 2, 0.0)  # 0.0 is not None


@pytest.mark.parametrize("length", [0, 1, 4096])
def test_packed_logprobs_are_the_bytes_assigning_them_gives(length):
    """`completion_to_pb` writes the log-probs as one packed field built from the array's
    bytes; the message is byte for byte the one assigning the floats builds, and parses back
    bit for bit, special values included."""
    rng = np.random.default_rng(length)
    lps = (-rng.exponential(2.0, length)).astype(np.float32)
    special = np.array([-0.0, -np.inf, np.nan, -1e-45, np.finfo(np.float32).min], np.float32)
    lps[: min(length, 5)] = special[: min(length, 5)]
    ids = rng.integers(0, 2**31 - 1, length, dtype=np.int32)
    c = m.Completion(ids, lps, "length", 1, 1, ((1, 0, length),))
    pb = cv.completion_to_pb(c)
    plain = cv.rpb.Completion()
    plain.CopyFrom(pb)
    plain.ClearField("logprobs")
    plain.logprobs.extend(lps.tolist())
    assert pb.SerializeToString() == plain.SerializeToString()
    back = cv.completion_from_pb(cv.rpb.Completion.FromString(pb.SerializeToString()))
    assert back.logprobs.tobytes() == lps.tobytes() and back.token_ids.tolist() == ids.tolist()


def test_unknown_finish_reason_is_refused():
    c = m.Completion(np.zeros(1, np.int32), np.zeros(1, np.float32), "eos", 0, 0)
    with pytest.raises(
        ValueError, match=r"expected one of \('stop', 'length', 'abort'\), got 'eos'"
    ):
        cv.completion_to_pb(c)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lease_seconds", 0.0, "lease_seconds: expected a finite number of seconds > 0, got 0.0"),
        ("heartbeat_interval_s", 40.0, "expected 0 <= it < heartbeat_timeout_s (30.0), got 40.0"),
        ("rollout_capacity", 0, "rollout_capacity: expected >= 1, got 0"),
        ("max_message_bytes", 1000, "expected >= 1048576 (1 MiB), got 1000"),
    ],
)
def test_config_refuses_impossible_values(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GatewayConfig(**{field: value})
