"""`StopStringMatcher`: the same cut as `episode.cut_at_stop`, found while tokens arrive."""

import numpy as np
import pytest

from gateway import messages as m
from rollout_engine.episode import cut_at_stop
from rollout_engine.jax.stop_strings import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    StopStringMatcher,
    check_stop_strings,
)


def byte_decode(ids: list[int]) -> str:
    """Byte-level ids -> text; a multi-byte character cut short decodes as U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def completion(ids: list[int]) -> m.Completion:
    n = len(ids)
    return m.Completion(ids, -np.ones(n, np.float32), "length", 0, 0, ((0, 0, n),))


def test_a_stop_found_at_the_token_that_completes_it():
    ids = list(b"ab<calc>1+2</calc>xyz</calc>")
    matcher = StopStringMatcher(("</calc>",), byte_decode)
    assert matcher.push(ids[:12]) is None
    k = matcher.push(ids[12:])
    assert k == len("ab<calc>1+2</calc>") == 18
    assert matcher.push([ord("q")]) == 18 and len(matcher.ids) == 18  # later tokens ignored


def test_a_stop_spanning_a_split_multibyte_character():
    """'é' is two bytes: the first decodes as U+FFFD, the text changes behind the tail."""
    ids = list("xé!".encode())
    matcher = StopStringMatcher(("é!",), byte_decode)
    got = [matcher.push([t]) for t in ids]
    assert got == [None, None, None, 4]


@pytest.mark.parametrize("seed", range(20))
def test_matches_cut_at_stop_on_random_streams(seed):
    rng = np.random.default_rng(seed)
    alphabet = list(b"ab</>") + list("é".encode())
    ids = [int(t) for t in rng.choice(alphabet, size=60)]
    stops = ("</a>", "bé", "<<b")
    want = len(cut_at_stop(completion(ids), byte_decode, stops).token_ids)
    k = StopStringMatcher(stops, byte_decode).push(ids)
    assert (k or len(ids)) == want


def test_no_stop_strings_never_stop():
    assert StopStringMatcher((), byte_decode).push(list(b"anything")) is None


def test_bounds_on_stop_strings():
    assert check_stop_strings(["a"] * MAX_STOP_STRINGS) == ("a",) * MAX_STOP_STRINGS
    with pytest.raises(ValueError, match="more than the limit 16"):
        check_stop_strings(["a"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="non-empty"):
        check_stop_strings([""])
    with pytest.raises(ValueError, match="characters, more than the limit"):
        check_stop_strings(["x" * (MAX_STOP_CHARS + 1)])
