"""Writes docs/config.md, the configuration reference, from the job config's pydantic schema
(`trainer.launch.job_config.JobConfig`, whose `run` is `trainer.config.Config`): every key with
its type, default, bounds and docstring. `tests/unit/test_docs.py` renders it again in memory
and fails when the page and the schema disagree.

    python scripts/config_reference.py          # rewrites docs/config.md
"""

from __future__ import annotations

import enum
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config.md"

HEAD = """# Configuration reference

Generated from the pydantic schema (`trainer/config.py`, `trainer/launch/job_config.py`) by
`python scripts/config_reference.py`; `tests/unit/test_docs.py` fails when this page and the
schema disagree. Do not edit it by hand.

One YAML file holds every section; any key is overridden on the command line as
`section.key=value` (`logging.wandb.key=value` one level deeper; `run_dir=PATH` is short for
`trainer.run_dir=PATH`). A wrong key or value stops the job at once with a message naming it.
"""


def _type(annotation: Any) -> str:
    """A short, table-safe name of a field's type (no `|`: it would split the cell)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = ", ".join("..." if a is Ellipsis else _type(a) for a in args)
        return f"{name}[{inner}]" if inner else name
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    return "`" + repr(value).replace("|", "\\|") + "`"


def _bounds(field: FieldInfo) -> str:
    out = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                out.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "pattern", None):
            out.append(f"matches `{meta.pattern}`")
    return "; ".join(out)


def _text(text: str | None) -> str:
    return re.sub(r"\s+", " ", text or "").strip().replace("|", "\\|")


def _sections(model: type[BaseModel], prefix: str) -> list[tuple[str, type[BaseModel]]]:
    """(dotted prefix, section model) for `model` and every section under it, depth first."""
    out = [(prefix, model)]
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _sections(sub, f"{prefix}.{name}" if prefix else name)
    return out


def _table(prefix: str, model: type[BaseModel]) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            continue
        bounds = _bounds(field)
        meaning = _text(field.description) + (f" ({bounds})" if bounds else "")
        kind, default = _type(field.annotation), _default(field)
        rows.append(f"| `{prefix}.{name}` | {kind} | {default} | {meaning} |")
    if not rows:
        return []
    lines = [f"## `{prefix}`", "", _text(model.__doc__), ""]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    return lines


def render() -> str:
    """The whole page, from the schema as imported now."""
    from trainer.config import Config
    from trainer.launch.job_config import JobConfig

    lines = [HEAD]
    for name, field in Config.model_fields.items():
        for prefix, model in _sections(field.annotation, name):  # type: ignore[arg-type]
            lines += _table(prefix, model)
    for name, field in JobConfig.model_fields.items():
        if name == "run":
            continue
        for prefix, model in _sections(field.annotation, name):  # type: ignore[arg-type]
            lines += _table(prefix, model)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
