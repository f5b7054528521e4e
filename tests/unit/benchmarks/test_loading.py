"""`load_benchmark`: a benchmark script loads once as a module of its name, with its sibling
imports; a missing script is named; a script whose import fails leaves nothing behind."""

from __future__ import annotations

import sys

import pytest

from tests.unit.benchmarks import loading
from tests.unit.benchmarks.loading import load_benchmark


def test_loads_once_under_its_name() -> None:
    module = load_benchmark("push_phases")
    assert sys.modules["push_phases"] is module
    assert load_benchmark("push_phases") is module
    assert str(loading.BENCHMARKS) not in sys.path


def test_sibling_import_and_failures(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(loading, "BENCHMARKS", tmp_path)
    (tmp_path / "kvrep_sibling.py").write_text("VALUE = 7\n")
    (tmp_path / "kvrep_uses.py").write_text("from kvrep_sibling import VALUE\nTWICE = 2 * VALUE\n")
    (tmp_path / "kvrep_broken.py").write_text("raise RuntimeError('broken at import')\n")
    try:
        assert load_benchmark("kvrep_uses").TWICE == 14
        with pytest.raises(FileNotFoundError, match="kvrep_missing.py"):
            load_benchmark("kvrep_missing")
        with pytest.raises(RuntimeError, match="broken at import"):
            load_benchmark("kvrep_broken")
        assert "kvrep_broken" not in sys.modules
        assert str(tmp_path) not in sys.path
    finally:
        for name in ("kvrep_sibling", "kvrep_uses", "kvrep_broken"):
            sys.modules.pop(name, None)
