"""The docs hold to the code: the configuration reference is the schema's own page, and every
repository path the README and docs/ name in backticks exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("trainer", "gateway", "rollout_engine", "mappings", "transport", "envs", "protos",
       "tests", "benchmarks", "configs", "scripts", "deploy", "docs")  # fmt: skip
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"`((?:" + "|".join(TOP) + r")/[A-Za-z0-9_./-]*)`")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted(ROOT.glob("*/README.md"))]  # fmt: skip


def test_config_page_is_the_schema():
    script = ROOT / "scripts" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == module.render(), (
        "docs/config.md differs from the config schema: run `python scripts/config_reference.py`"
    )


def test_config_page_names_every_key():
    from trainer.launch.job_config import LaunchSection

    page = (ROOT / "docs" / "config.md").read_text()
    for key in LaunchSection.model_fields:
        assert f"`launch.{key}`" in page


def test_named_paths_exist():
    missing = []
    for page in _pages():
        for line_no, line in enumerate(page.read_text().splitlines(), 1):
            for path in PATH.findall(line):
                if not (ROOT / path).exists():
                    missing.append(f"{page.relative_to(ROOT)}:{line_no}: {path}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


def test_readme_links_exist():
    text = (ROOT / "README.md").read_text()
    links = [link for link in LINK.findall(text) if "://" not in link]
    assert links, "README.md links to no page"
    assert [link for link in links if not (ROOT / link).exists()] == []
