"""absl / orbax warnings go to RUN_DIR/logs/trainer.log during a job, not onto the terminal
(where they were glued onto the progress bar); the job's own loggers still print."""

from __future__ import annotations

import logging

from trainer.launch.library_logs import route_library_logs, unroute_library_logs

NOTE = "Waiting for previous save to complete took 8.7 seconds. If this number is high, ..."


def test_library_warnings_go_to_the_run_log(tmp_path, capsys):
    root = logging.getLogger()
    terminal = logging.StreamHandler()  # what logging.basicConfig gives the job
    root.addHandler(terminal)
    try:
        handler = route_library_logs(tmp_path / "logs")
        try:
            logging.getLogger("absl").warning(NOTE)
            logging.getLogger("orbax.checkpoint").warning("orbax note")
            logging.getLogger("trainer.launch.job").warning("the job's own warning")
        finally:
            unroute_library_logs(handler)
        logging.getLogger("absl").warning("after the job")
    finally:
        root.removeHandler(terminal)
    assert capsys.readouterr().err.splitlines() == ["the job's own warning", "after the job"]
    lines = (tmp_path / "logs" / "trainer.log").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == [
        f"absl WARNING {NOTE}",
        "orbax.checkpoint WARNING orbax note",
    ]
