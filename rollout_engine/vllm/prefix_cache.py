"""vLLM's prefix-cache counters, read in the process that runs its `AsyncLLM` front end.

vLLM counts, per engine, the prompt tokens each new request looked up in its prefix cache
(``vllm:prefix_cache_queries``) and those it found there (``vllm:prefix_cache_hits``); the
cache holds whole KV blocks only (`rollout_engine.config.VllmOptions.block_size`). A
multi-turn episode's later turn should find its whole history but the last partial block.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PrefixCacheCounts:
    """Running totals since the engine started, in prompt tokens, summed over engines.

    Attributes:
        queries: prompt tokens looked up. hits: prompt tokens found cached.
    """

    queries: int
    hits: int

    def __sub__(self, other: PrefixCacheCounts) -> PrefixCacheCounts:
        return PrefixCacheCounts(self.queries - other.queries, self.hits - other.hits)

    @property
    def hit_rate(self) -> float:
        """hits / queries (0 when nothing was looked up)."""
        return self.hits / self.queries if self.queries else 0.0


def prefix_cache_counts() -> PrefixCacheCounts:
    """The counters now (vLLM's `get_metrics_snapshot`; zeros before any engine logged them).

    The engine must run with its statistics on (`AsyncEngineArgs.disable_log_stats` False,
    vLLM's default and the backend's)."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    counters = [x for x in get_metrics_snapshot() if isinstance(x, Counter)]

    def total(name: str) -> int:
        return int(sum(x.value for x in counters if x.name == name))

    return PrefixCacheCounts(total("vllm:prefix_cache_queries"), total("vllm:prefix_cache_hits"))
