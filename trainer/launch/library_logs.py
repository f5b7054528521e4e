"""Where the libraries' own log lines go during a job: ``RUN_DIR/logs/trainer.log``, not the
terminal, so they are not glued onto the progress bar.

absl (and orbax, which logs through absl: "Waiting for previous save to complete took N
seconds...") and JAX log warnings that say nothing the user must act on; the run keeps them
in the file. The job's own loggers (trainer, gateway, rollout_engine) still print.
"""

from __future__ import annotations

import logging
from pathlib import Path

LIBRARY_LOGGERS = ("absl", "orbax", "jax", "tensorstore")
LOG_NAME = "trainer.log"


def route_library_logs(log_dir: Path) -> logging.Handler:
    """Send `LIBRARY_LOGGERS` to ``log_dir/trainer.log`` (created, appended to) instead of the
    root logger's handlers; returns the file handler (`unroute_library_logs` undoes it)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / LOG_NAME)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False
    return handler


def unroute_library_logs(handler: logging.Handler) -> None:
    """Undo `route_library_logs`: the loggers propagate to the root again; the file is closed."""
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.removeHandler(handler)
        logger.propagate = True
    handler.close()
