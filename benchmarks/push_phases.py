"""Where the seconds of a weight push go: the trainer's own phase seconds of the send
(`PushStats.send_phases`) joined with the engine's of its update (the vLLM worker logs them
with each "loaded version" line, `rollout_engine.worker`), in five parts that do not overlap
on either side's clock:

- `pack_s`: the sender packing the buckets (mapping layout, cast to the wire dtype, copy into
  its buffers);
- `wire_s`: the sender waiting for its buckets on the wire beyond the packing (gloo's
  broadcast, which also waits while the receiver has not posted the next bucket);
- `receive_copy_s`: the receiver unpacking the buckets it received (the slowest TP worker);
- `engine_load_s`: vLLM's own work on them: the layerwise reload's set-up, `load_weights` of
  each bucket, its finalisation and the prefix-cache reset;
- `commit_vote_s`: the control path around them: from "published" to every engine "ready"
  (the safe point), the engine's pause and the manifest offer beyond the reload's set-up,
  the receivers' commit vote, and from the send's end to every "loaded" ack beyond the
  engine's finalisation and reset.

The receiver copies and loads bucket k while the sender packs and sends bucket k + 1
(`transport.collective.PIPELINE_DEPTH`), so the parts can add up to more than the push by
what that pipelining overlaps: at most the copy and load of every bucket but the last.
"""

from __future__ import annotations

import json
import re
from typing import Any

BREAKDOWN_KEYS = ("pack_s", "wire_s", "receive_copy_s", "engine_load_s", "commit_vote_s")
"""The parts of a push, in the order its bytes meet them (see the module docstring)."""

_LOADED = re.compile(r"loaded version (\d+) in [0-9.]+ s; phases (\{.*\})")


def engine_phases(log_text: str) -> dict[int, dict[str, float]]:
    """Version -> the engine's seconds by phase of its update to it, from an engine log
    written at level INFO (the worker's "loaded version V in S s; phases {...}" lines); a
    version loaded twice keeps its last line."""
    return {int(v): json.loads(p) for v, p in _LOADED.findall(log_text)}


def push_breakdown(stats: Any, engine: dict[str, float]) -> dict[str, float]:
    """The five parts of one push in seconds (`BREAKDOWN_KEYS`, each >= 0).

    Args:
        stats: its `trainer.publish.PushStats` (with the collective sender's `send_phases`).
        engine: the engine's phases of that version (`engine_phases`: the vLLM backend's
            "start_s", "wait_s", "copy_s", "load_s", "commit_s", "finish_s", "reset_s").

    Raises:
        KeyError: a phase missing on either side (a transport or engine that does not time
            them).
    """
    send = stats.send_phases
    load = engine["start_s"] + engine["load_s"] + engine["finish_s"] + engine["reset_s"]
    handshake = max(stats.ready_s + stats.loaded_s - engine["finish_s"] - engine["reset_s"], 0.0)
    offer = max(send["offer_s"] - engine["start_s"], 0.0)
    parts = {
        "pack_s": send["pack_s"],
        "wire_s": send["wire_s"],
        "receive_copy_s": engine["copy_s"],
        "engine_load_s": load,
        "commit_vote_s": handshake + offer + engine["commit_s"],
    }
    return {k: max(v, 0.0) for k, v in parts.items()}
