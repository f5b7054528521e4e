"""Stop strings matched on the host, one decoded token at a time (issue 28, item 2).

A sample with stop strings ends after the first token whose prefix text holds one of them: the
completion is its shortest prefix ``ids[:k]`` with ``any(s in decode(ids[:k]) for s in stops)``,
the string kept in it. That is the cut vLLM makes with ``stop=...`` and
``include_stop_str_in_output=True`` (our vLLM backend's settings) on whole tokens, and the cut
`rollout_engine.episode.cut_at_stop` makes after the fact; this class finds the same ``k`` while
tokens arrive, so an engine can end the sample at that step.

Cost per token: one decode of the prefix so far (the text of a prefix is not always a prefix
of the longer text: a multi-byte character split over tokens decodes as U+FFFD until its last
byte arrives), then a search of only the changed tail, widened by ``max(len(s)) - 1``
characters, since the text before it held no stop string at the previous token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_STOP_STRINGS = 16
"""Most stop strings one request may carry (vLLM sets no limit; ours bounds the host work)."""
MAX_STOP_CHARS = 256
"""Most characters of one stop string."""

Decode = Callable[[list[int]], str]
"""Token ids -> text (special tokens skipped), e.g. a tokenizer's ``decode``."""


def check_stop_strings(stops: Sequence[str]) -> tuple[str, ...]:
    """The stop strings as a tuple, after the bounds every engine applies.

    Raises:
        ValueError: more than `MAX_STOP_STRINGS` strings, an empty string (it would end every
            sample at its first token), or one longer than `MAX_STOP_CHARS` characters.
    """
    stops = tuple(stops)
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(stops)} stop strings, more than the limit {MAX_STOP_STRINGS}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(
                f"a stop string of {len(s)} characters, more than the limit {MAX_STOP_CHARS}"
            )
    return stops


class StopStringMatcher:
    """Finds the token at which one sample's text first holds a stop string.

    Args:
        stops: the sample's stop strings (bounded by `check_stop_strings`).
        decode: ids -> text, the same function `cut_at_stop` is given.

    Raises:
        ValueError: see `check_stop_strings`.
    """

    def __init__(self, stops: Sequence[str], decode: Decode) -> None:
        self.stops = check_stop_strings(stops)
        self.decode = decode
        self.window = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.stop_at: int | None = None
        """k: the completion holds ``ids[:k]`` (the stop string's last token included), once
        found; None before."""

    def push(self, tokens: Sequence[int]) -> int | None:
        """Append completion tokens (``[n]`` int ids, in order); returns `stop_at` (the first
        ``k`` whose prefix text holds a stop, counted over every token pushed so far) or None.
        Tokens pushed after the stop is found are ignored."""
        for t in tokens:
            if self.stop_at is not None or not self.stops:
                break
            self.ids.append(int(t))
            text = self.decode(self.ids)
            same = _common_prefix_len(self.text, text)
            tail = text[max(0, same - self.window) :]
            self.text = text
            if any(s in tail for s in self.stops):
                self.stop_at = len(self.ids)
        return self.stop_at


def _common_prefix_len(a: str, b: str) -> int:
    """The number of leading characters ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
