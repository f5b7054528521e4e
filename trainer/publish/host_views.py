"""Host views of the trainer's params for a push: each tensor fetched (and cast) one at a
time, a whole CPU-held param as a view of its own buffer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np


class HostView(Mapping):
    """A read-only view of flat params whose items come back as numpy arrays on access: a
    param held whole on one CPU device (or already numpy) as a view of its buffer in its own
    dtype (no copy, no cast); any other param cast to `dtype` in JAX first (items already in
    `dtype` are not cast), then fetched to the host."""

    def __init__(self, params: Mapping, dtype: Any) -> None:
        self._params = params
        self._dtype = dtype

    def __getitem__(self, key: str) -> np.ndarray:
        x = self._params[key]
        if isinstance(x, np.ndarray) or on_one_cpu(x):
            return np.asarray(x)
        if x.dtype != self._dtype:
            x = jnp.asarray(x).astype(self._dtype)
        return np.asarray(x)

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def on_one_cpu(x: Any) -> bool:
    """Whether `x` is a JAX array held whole on a single CPU device (so `np.asarray` shares
    its buffer)."""
    devices = getattr(x, "devices", None)
    if devices is None:
        return False
    ds = devices()
    return len(ds) == 1 and next(iter(ds)).platform == "cpu"


def flat_of(model_or_params: Any, merged: bool = True) -> Mapping:
    """Flat params by dot path of a `Decoder` as the engines serve them (with `merged`, a
    LoRA model's adapters merged into their kernels: `models.lora.engine_params`; without,
    every param as it is, adapters beside their kernels: `models.params.flat_params`), or the
    mapping itself."""
    if isinstance(model_or_params, Mapping):
        return model_or_params
    from models.lora import engine_params
    from models.params import flat_params

    return engine_params(model_or_params) if merged else flat_params(model_or_params)


def host_copies(
    items: Iterable[tuple[str, Any]], spare: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Host copies of (name, array) items by name, each written into `spare`'s buffer of
    that name when its shape and dtype match (no page faults: a copy into fresh arrays was
    several times slower than one into kept ones), a new array otherwise."""
    out = {}
    for name, x in items:
        src = np.asarray(x)
        buf = spare.get(name)
        if buf is not None and buf.shape == src.shape and buf.dtype == src.dtype:
            np.copyto(buf, src)
            out[name] = buf
        else:
            out[name] = np.array(src)
    return out
