"""Failures a user causes and fixes (a wrong path, a gateway nobody listens on, a refused token,
a damaged checkpoint), told in one or two plain lines.

`UserError` carries the sentence the command line prints instead of a traceback; the
traceback still goes to ``RUN_DIR/logs/trainer_error.log`` (`trainer.launch.job.run_job`).
Raise it where the cause is known, from the original exception, so the log keeps both.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure the user can fix; ``str(err)`` is the one or two lines to print (what was
    wrong, naming the setting or the path, and what to do)."""
