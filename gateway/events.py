"""The gateway's event log: what happened to engines, leases and versions, with timestamps.

Each event is one JSON object: ``{"t": wall-clock seconds (time.time()), "event": KIND,
...fields}``. Kinds and their fields:

| event | fields |
| --- | --- |
| `registered` | `engine`, `weight_version` (the engine's), `current` (the gateway's version) |
| `deregistered` | `engine`, `by` (the caller's role: `engine` left, or `trainer` dropped it) |
| `dropped` | `engine`, `reason` (why: deregistered, missed heartbeats, stream broke) |
| `leases_requeued` | `engine`, `leases`, `prompts` (prompts sent back to the queue) |
| `leased` | `engine`, `lease`, `prompts`, `weight_version` (the engine's), `current` |
| `published` | `version`, `replan` (true when a version's data-plane plan changed), `engines` |
| `loaded` | `engine`, `version`, `current` (the gateway's version at the ack) |
| `sync_failed` | `engine`, `version`, `serving`, `error` (at most 300 characters) |
| `stale_ack` | `engine`, `version`, `phase`, `seq` (the plan it answers), `current_seq`: ignored |

`EventLog` keeps the last `keep` events in memory (tests read them with `events()`) and, when
given a path, appends each one to that JSONL file at once (flushed), so another process (a
test, a benchmark) can time an engine's death against its leases going back to the queue.
Pure Python: the gateway process imports it.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_ERROR_CHARS = 300


class EventLog:
    """A bounded, thread-safe list of gateway events, optionally mirrored to a JSONL file.

    Args:
        path: JSONL file to append to (its folder is created); None keeps events in memory only.
        keep: how many recent events `events()` returns (>= 1).
        clock: wall-clock seconds for the `t` field (injectable for tests).

    Raises:
        ValueError: keep < 1. OSError: the file cannot be opened.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        keep: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep: expected >= 1 events, got {keep}")
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._clock = clock
        self._lock = threading.Lock()
        self._file = None
        if path is not None:
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            self._file = p.open("a", encoding="utf-8")

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Record one event now; returns it. A string field `error` is cut to 300 chars."""
        if isinstance(fields.get("error"), str):
            fields["error"] = fields["error"][:MAX_ERROR_CHARS]
        row = {"t": self._clock(), "event": event, **fields}
        with self._lock:
            self._recent.append(row)
            if self._file is not None:
                self._file.write(json.dumps(row, sort_keys=True) + "\n")
                self._file.flush()
        return row

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The recent events, oldest first (only those of `kind` when given)."""
        with self._lock:
            return [dict(e) for e in self._recent if kind is None or e["event"] == kind]

    def close(self) -> None:
        """Close the file (events after this stay in memory only)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every event of a JSONL event file, oldest first (a torn last line is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
