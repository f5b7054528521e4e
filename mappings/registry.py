"""Finds a family's mapping by name: `mappings/families/<name>.py` defines `FAMILY`."""

from __future__ import annotations

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
