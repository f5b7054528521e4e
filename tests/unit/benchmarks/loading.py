"""One way for tests to import a benchmark script (`benchmarks/<name>.py`, not a package) as a
module: `load_benchmark(name)`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

#: The repository's benchmarks folder.
BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` run as the module `name` and registered in ``sys.modules`` under
    it (dataclasses and pickling look a class's module up by name); loaded once, later calls
    return that module. While it runs, the benchmarks folder is first on ``sys.path``, as when
    the script is run (so its own ``from train_step import ...`` of a sibling works), and taken
    off after.

    Raises:
        FileNotFoundError: there is no `benchmarks/<name>.py` (names the path).
    """
    if name in sys.modules:
        return sys.modules[name]
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark script {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a failed import leaves nothing half-loaded behind
        raise
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
