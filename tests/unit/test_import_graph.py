"""The import graph of the packages is the README's layout table, edge for edge.

Every `.py` file of the packages (generated protobuf stubs aside) is parsed with `ast`; each
`import` / `from ... import` anywhere in it (module level, under `if TYPE_CHECKING:`, inside
functions: lazy imports count) and each `importlib.import_module("literal")` that names another
package of the table must be allowed by the README:
- the layout table (`| package | what it is | may import |`) says which packages each package
  may import;
- the exceptions table (`| file or folder | may also import | where | why |`) allows a file or
  folder one more module, "inside functions" (lazy imports only) or "anywhere".

Both directions are checked: an import the tables do not allow fails, naming the file, the line
and the import; an allowed edge or exception that no file uses fails too (the table would
promise more than the code), so the table is the graph. The packages of the table are also the
ones `pyproject.toml` installs.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYOUT_HEADER = ("package", "what it is", "may import")
EXCEPTIONS_HEADER = ("file or folder", "may also import", "where", "why")
WHERE = ("inside functions", "anywhere")


@dataclass(frozen=True)
class Allowance:
    """One row of the exceptions table: files under `path` may import `module` (and its
    submodules); only inside functions when `lazy`."""

    path: str
    module: str
    lazy: bool


@dataclass(frozen=True)
class Import:
    """One import of another package: `path:line` imports `module`; `lazy` when it runs inside
    a function."""

    path: str
    line: int
    module: str
    lazy: bool

    @property
    def package(self) -> str:
        return self.module.split(".")[0]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(text: str, header: tuple[str, ...]) -> list[list[str]]:
    """The body rows of the markdown table in `text` whose header row is `header`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("|") and tuple(_cells(line)) == header:
            rows = []
            for body in lines[i + 2 :]:
                if not body.lstrip().startswith("|"):
                    break
                rows.append(_cells(body))
            return rows
    raise AssertionError(f"README.md has no table with the header {' | '.join(header)}")


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def read_tables(text: str) -> tuple[dict[str, set[str]], list[Allowance]]:
    """(package -> packages it may import, exceptions) from the README's two tables."""
    allowed: dict[str, set[str]] = {}
    for row in _table(text, LAYOUT_HEADER):
        (package,) = _ticked(row[0])
        allowed[package.rstrip("/")] = {p.rstrip("/") for p in _ticked(row[2])}
    exceptions = []
    for row in _table(text, EXCEPTIONS_HEADER):
        (path,) = _ticked(row[0])
        (module,) = _ticked(row[1])
        assert row[2] in WHERE, f"exceptions table: where {row[2]!r} is not one of {WHERE}"
        assert row[3], f"exceptions table: {path} -> {module} gives no reason"
        exceptions.append(Allowance(path, module, row[2] == "inside functions"))
    return allowed, exceptions


def source_imports(source: str, rel: str, packages: set[str]) -> list[Import]:
    """Every import of a package of `packages` in the Python `source` of file `rel`."""
    tree = ast.parse(source, filename=rel)
    out: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            if name.split(".")[0] in packages:
                out.append(Import(rel, node.lineno, name, lazy))  # type: ignore[attr-defined]
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return out


def all_imports(packages: set[str]) -> list[Import]:
    """Every import, by any file of `packages`, of a package of `packages` (its own included)."""
    out = []
    for package in sorted(packages):
        for path in sorted((ROOT / package).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                rel = path.relative_to(ROOT).as_posix()
                out += source_imports(path.read_text(), rel, packages)
    return out


def _covers(exc: Allowance, imp: Import) -> bool:
    in_path = imp.path == exc.path or imp.path.startswith(exc.path.rstrip("/") + "/")
    in_module = imp.module == exc.module or imp.module.startswith(exc.module + ".")
    return in_path and in_module and (imp.lazy or not exc.lazy)


def violations(
    imports: list[Import], allowed: dict[str, set[str]], exceptions: list[Allowance]
) -> list[str]:
    """Each import the tables do not allow, as `path:line: package -> module (lazy)`."""
    bad = []
    for imp in imports:
        own = imp.path.split("/")[0]
        if imp.package == own or imp.package in allowed[own]:
            continue
        if any(_covers(e, imp) for e in exceptions):
            continue
        how = " (inside a function)" if imp.lazy else ""
        bad.append(f"{imp.path}:{imp.line}: {own} may not import {imp.module}{how}")
    return bad


@pytest.fixture(scope="module")
def tables() -> tuple[dict[str, set[str]], list[Allowance]]:
    return read_tables((ROOT / "README.md").read_text())


def test_tables_name_the_installed_packages(tables):
    allowed, exceptions = tables
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = {p.rstrip("*") for p in include}
    assert set(allowed) == installed
    for package, targets in allowed.items():
        assert targets <= installed, f"{package} may import {targets - installed}, not packages"
    for e in exceptions:
        assert e.path.split("/")[0] in installed and (ROOT / e.path).exists(), e
        assert e.module.split(".")[0] in installed, e


def test_every_import_is_allowed(tables):
    allowed, exceptions = tables
    imports = all_imports(set(allowed))
    assert len(imports) > 100  # the walk found the packages' imports
    bad = violations(imports, allowed, exceptions)
    assert not bad, "imports the README's layout table forbids:\n" + "\n".join(bad)


def test_every_allowed_edge_is_used(tables):
    allowed, exceptions = tables
    imports = all_imports(set(allowed))
    used = {(i.path.split("/")[0], i.package) for i in imports}
    unused = [f"{p} -> {t}" for p, ts in allowed.items() for t in ts if (p, t) not in used]
    assert not unused, f"the layout table allows imports no file makes: {unused}"
    needed = []
    for e in exceptions:
        own = e.path.split("/")[0]
        hits = [i for i in imports if _covers(e, i)]
        if not hits or all(i.package in allowed[own] for i in hits):
            needed.append(f"{e.path} -> {e.module}")
    assert not needed, f"exceptions no file needs: {needed}"


def test_a_forbidden_import_is_named_with_its_file_and_line(tables):
    """The checker itself: imports the tables forbid are found at module level, under
    `if TYPE_CHECKING:`, inside functions and through `importlib.import_module`."""
    allowed, exceptions = tables
    source = (
        "import typing\n"
        "from gateway.client import GatewayClient\n"  # allowed: trainer -> gateway
        "if typing.TYPE_CHECKING:\n"
        "    from rollout_engine.backend import Backend\n"
        "def f():\n"
        "    import rollout_engine.worker\n"
        "    importlib.import_module('rollout_engine.cli')\n"
    )
    imports = source_imports(source, "trainer/_import_graph_probe.py", set(allowed))
    assert violations(imports, allowed, exceptions) == [
        "trainer/_import_graph_probe.py:4: trainer may not import rollout_engine.backend",
        "trainer/_import_graph_probe.py:6: trainer may not import rollout_engine.worker "
        "(inside a function)",
        "trainer/_import_graph_probe.py:7: trainer may not import rollout_engine.cli "
        "(inside a function)",
    ]
    # an exception that allows only lazy imports does not allow the same import at module level
    check = Allowance("mappings/check.py", "models", lazy=True)
    assert _covers(check, Import("mappings/check.py", 5, "models.config", lazy=True))
    assert not _covers(check, Import("mappings/check.py", 5, "models.config", lazy=False))
    assert not _covers(check, Import("mappings/spec.py", 5, "models.config", lazy=True))
