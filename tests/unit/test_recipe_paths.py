"""The separate-hosts recipe (docs/clusters.md) writes nothing into the repository that `git status`
shows: its token file and tiny model go under the git-ignored runs/, and make-tokens makes that
folder; a token file or a tiny model folder left in the root by an older recipe is ignored too."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _recipe() -> str:
    text = (ROOT / "docs" / "clusters.md").read_text()
    return text[text.index("## Running on separate hosts") : text.index("### Clusters")]


def test_recipe_writes_under_runs():
    recipe = _recipe()
    assert re.findall(r"make-tokens (\S+)", recipe) == ["runs/tokens.txt"]
    assert re.findall(r"make\('([^']+)'", recipe) == ["runs/tiny-smollm2"]
    assert re.findall(r"--token-file ([^\s`]+)", recipe) == ["runs/tokens.txt"] * 4
    assert set(re.findall(r"token_file=(\S+)", recipe)) == {"runs/tokens.txt"}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_what_the_recipe_writes_is_ignored():
    paths = ["runs/tokens.txt", "runs/tiny-smollm2/config.json", "tokens.txt",
             "tiny-smollm2/model.safetensors"]  # fmt: skip
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert done.stdout.splitlines() == paths


def test_make_tokens_makes_its_folder(tmp_path):
    target = tmp_path / "runs" / "tokens.txt"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "make-tokens", str(target)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout == f"wrote trainer and engine tokens to {target}\n"
    assert sorted(line.split("=")[0] for line in target.read_text().splitlines()[1:]) == [
        "engine", "trainer"
    ]  # fmt: skip
    assert target.stat().st_mode & 0o777 == 0o600
