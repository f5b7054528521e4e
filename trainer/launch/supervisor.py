"""Keeps the engines a launcher started alive: a dead one is restarted, with backoff.

`EngineSupervisor` watches the named engine children of a `ProcessSet` from its own thread
(every `poll_s` seconds). An engine that exited with a non-zero status (killed, crashed, lost
its gateway) is started again after ``backoff_s * 2**k`` seconds (k: its restarts so far,
capped at `backoff_max_s`), at most `max_restarts` times over the run; an engine that exited 0
(the gateway shut down, or it was asked to stop) is left alone. Each start and restart is
written to ``LOG_DIR/children.json`` (name -> pid, restarts, status), so a test or an operator
can find an engine's process.

`on_death(name)` (optional) is called from the thread as soon as a death is seen: the main job
uses it to deregister the dead engine on the gateway at once (`deregister_dead`), so its
leases go back to the queue even when no long poll of it was in flight to break.

`check()` is the trainer's `before_update` hook: it raises when the run cannot go on — a
non-engine child (the gateway) exited, or fewer than `min_engines` engines are alive or about
to be restarted — and otherwise lets the run go on while restarts happen.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainer.launch.processes import ProcessSet

log = logging.getLogger(__name__)


class EngineSupervisor:
    """Restarts dead engine processes (see the module docstring).

    Args:
      procs: the launcher's children (engines and others).
      engines: names of the engine children in `procs`.
      restart: restart dead engines (launch.restart_engines); False only watches.
      max_restarts: most restarts per engine (>= 0).
      backoff_s: wait before an engine's first restart (seconds, > 0); doubled each time.
      backoff_max_s: cap of that wait (seconds).
      min_engines: fewest engines alive or pending a restart that `check` accepts (>= 1).
      poll_s: seconds between looks at the children (> 0).
      on_death: called with an engine's name when it is seen dead (errors are logged).

    Raises:
      ValueError: a bad count or duration.
    """

    def __init__(
        self,
        procs: ProcessSet,
        engines: Sequence[str],
        *,
        restart: bool = True,
        max_restarts: int = 5,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        min_engines: int = 1,
        poll_s: float = 0.2,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        if max_restarts < 0 or min_engines < 1 or backoff_s <= 0 or poll_s <= 0:
            raise ValueError(
                "expected max_restarts >= 0, min_engines >= 1, backoff_s > 0 and poll_s > 0; "
                f"got {max_restarts}, {min_engines}, {backoff_s}, {poll_s}"
            )
        self.procs = procs
        self.engines = tuple(engines)
        self.restart = restart
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.min_engines = min_engines
        self.poll_s = poll_s
        self.on_death = on_death
        self.restarts: dict[str, int] = dict.fromkeys(self.engines, 0)
        self.history: list[dict] = []  # one row per death: name, status, at, restarted
        self._due: dict[str, float] = {}  # engine -> monotonic time of its restart
        self._given_up: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="engine-supervisor", daemon=True)
        self._path = procs.log_dir / "children.json"

    def start(self) -> EngineSupervisor:
        """Start watching; returns self."""
        self._write()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (no restart after this returns)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def __enter__(self) -> EngineSupervisor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serving(self) -> int:
        """Engines alive or waiting for their restart."""
        with self._lock:
            alive = sum(self.procs.child(n).alive() for n in self.engines)
            return alive + len(self._due)

    def check(self) -> None:
        """Raise if the run cannot go on (the `before_update` hook).

        Raises:
          RuntimeError: a non-engine child exited (its log's tail inside), or fewer than
            `min_engines` engines are alive or pending a restart (names the dead ones and
            their exit statuses).
        """
        for child in list(self.procs.children):
            if child.name not in self.engines and child.proc.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with status {child.proc.returncode}; last lines of "
                    f"{child.log_path}:\n{child.tail()}"
                )
        self._tick()
        if self.serving() < self.min_engines:
            dead = {
                n: self.procs.child(n).proc.returncode
                for n in self.engines
                if not self.procs.child(n).alive()
            }
            raise RuntimeError(
                f"expected at least launch.min_engines={self.min_engines} engines, got "
                f"{self.serving()}: dead {dead} after restarts {self.restarts} (max "
                f"{self.max_restarts} each); see {self.procs.log_dir}"
            )

    # ----- the thread -----
    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - keep supervising; check() reports the state
                log.exception("engine supervisor tick failed")

    def _tick(self) -> None:
        with self._lock:
            if self.procs.stopping or self._stop.is_set():
                return
            now = time.monotonic()
            changed = False
            for name in self.engines:
                child = self.procs.child(name)
                code = child.proc.poll()
                if code is None or code == 0 or name in self._given_up:
                    continue
                if name not in self._due:
                    if self.on_death is not None:
                        try:
                            self.on_death(name)
                        except Exception:  # noqa: BLE001 - the gateway drops it later anyway
                            log.exception("on_death(%s) failed", name)
                    k = self.restarts[name]
                    if not self.restart or k >= self.max_restarts:
                        self._given_up.add(name)
                        log.error("%s exited with status %s; not restarting it", name, code)
                        self.history.append({"name": name, "status": code, "restarted": False})
                        changed = True
                        continue
                    wait = min(self.backoff_s * 2**k, self.backoff_max_s)
                    self._due[name] = now + wait
                    log.warning("%s exited with status %s; restarting in %.1f s", name, code, wait)
                    self.history.append({"name": name, "status": code, "restarted": True})
                elif now >= self._due[name]:
                    del self._due[name]
                    if self.procs.restart(name) is not None:
                        self.restarts[name] += 1
                        changed = True
            if changed:
                self._write()

    def _write(self) -> None:
        rows = {
            c.name: {
                "pid": c.proc.pid,
                "restarts": c.restarts,
                "status": c.proc.poll(),
                "engine": c.name in self.engines,
            }
            for c in list(self.procs.children)
        }
        tmp = Path(str(self._path) + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        tmp.replace(self._path)


def deregister_dead(trainer: Any) -> Callable[[str], None]:
    """An `on_death` for the main job: drop from the gateway every engine registered under the
    dead child's name (the launcher names engine i "engine{i}"), through the run's trainer-role
    client (`GatewayClient.drop_engine`: the trainer needs no engine key for it). A name the
    gateway no longer lists (it noticed first) is a no-op.
    """
    from gateway.errors import GatewayError

    def on_death(name: str) -> None:
        for e in trainer.status().engines:
            if e.name == name:
                try:
                    n = trainer.drop_engine(e.engine_id)
                except GatewayError as err:  # dropped meanwhile
                    log.info("dropping dead %s (%s): %s", name, e.engine_id, err)
                    continue
                log.warning("dropped dead %s (%s): %d prompts requeued", name, e.engine_id, n)

    return on_death
