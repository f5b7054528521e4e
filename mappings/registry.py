"""Finds a family's mapping by name: `mappings/families/<name>.py` defines `FAMILY`.

The one home of which families exist and which HF `model_type` selects which family: the
trainer's model config and the engine's config both ask here.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

import mappings.families
from mappings.spec import Family, MappingError


def available_families() -> list[str]:
    """Names of every family module (files in mappings/families/ not starting with "_")."""
    return sorted(
        m.name
        for m in pkgutil.iter_modules(mappings.families.__path__)
        if not m.name.startswith("_")
    )


def get_family(name: str) -> Family:
    """The `FAMILY` of `mappings.families.<name>`.

    Raises:
        MappingError: no such family; the message lists the available ones.
    """
    if name not in available_families():
        raise MappingError(f"no mapping for family {name!r}; available: {available_families()}")
    family = importlib.import_module(f"mappings.families.{name}").FAMILY
    if not isinstance(family, Family) or family.name != name:
        raise MappingError(f"mappings.families.{name}.FAMILY must be a Family named {name!r}")
    return family


@functools.cache
def model_types() -> dict[str, str]:
    """HF config.json `model_type` -> family name, from every family's `model_types` (or its
    name when it declares none).

    Raises:
        MappingError: two families claim one `model_type`, or a family module is broken.
    """
    table: dict[str, str] = {}
    for name in available_families():
        for model_type in get_family(name).model_types or (name,):
            if model_type in table:
                raise MappingError(
                    f"model_type {model_type!r}: expected one family to claim it, got "
                    f"{table[model_type]!r} and {name!r}"
                )
            table[model_type] = name
    return table


def family_for_model_type(model_type: object) -> str:
    """The family name whose mapping reads checkpoints of HF `model_type`.

    Raises:
        MappingError: no family claims it; the message lists the known model types.
    """
    table = model_types()
    if not isinstance(model_type, str) or model_type not in table:
        raise MappingError(
            f"model_type {model_type!r} is not supported; supported: {sorted(table)}"
        )
    return table[model_type]
