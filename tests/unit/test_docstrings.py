"""Docstrings say what the code does: no docstring of the packages (module, class, function,
and the attribute docstrings the config reference is generated from) carries a date or names
the host a figure was measured on (those figures live on docs/benchmarks.md, "Figures moved
from docstrings")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "gateway", "rollout_engine", "mappings", "transport", "envs")
DATE = re.compile(r"\b20\d{2}-\d{2}-\d{2}\b")
HOST = re.compile(
    r"EPYC|Xeon|\bAVX|\bAMX\b|this\s+(?:[\w-]+\s+)?(?:host|machine)|\b\d+-core\b", re.IGNORECASE
)


def _files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def offences(source: str, name: str) -> list[str]:
    """`name:line: match` for each date or host name in `source`'s docstrings: every string
    statement (a module's, class's or function's first, or one after an attribute), at the
    line of the match itself (1-based)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            continue
        text = node.value.value
        if not isinstance(text, str):
            continue
        first = node
        for pattern in (DATE, HOST):
            for match in pattern.finditer(text):
                line = first.lineno + text.count("\n", 0, match.start())
                found.append(f"{name}:{line}: {match.group(0)!r}")
    return found


def test_scanner_finds_a_date_and_a_host():
    source = 'def f():\n    """Do it.\n\n    Took 1 s on this host, an AMD EPYC, 2026-12-01."""\n'
    assert offences(source, "x.py") == [
        "x.py:4: '2026-12-01'",
        "x.py:4: 'this host'",
        "x.py:4: 'EPYC'",
    ]


def test_no_docstring_carries_a_date_or_a_host():
    assert _files()
    found = [
        o for path in _files() for o in offences(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, (
        "docstrings with a date or a host name (move the figure to docs/benchmarks.md):\n"
        + "\n".join(found)
    )
