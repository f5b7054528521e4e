"""Routing replay on the wire: a completion's routed experts as compact bytes.

A mixture-of-experts engine may return the experts every MoE layer's router chose in each
forward pass it ran over a sample: one row per input token, row i the pass over token i of
prompt + completion, for the P + T - 1 tokens before the last (see `protos/rollout.proto`,
`Completion.routed_experts`; the prompt's rows matter because their keys and values reach the
completion through attention). In memory they are int32 [R, L, k] (R = P + T - 1 rows, L MoE
layers, k experts per token); on the wire one unsigned little-endian integer per id, 1 byte
when every id is below 256, else 2, row-major, with L, k and the id width in their own
fields. A dense model or an engine not asked for routes sends none (empty bytes, the three
counts 0).
"""

from __future__ import annotations

import numpy as np

from gateway.errors import invalid

#: Id width on the wire (bytes) -> its little-endian unsigned dtype.
_WIDTH_DTYPE: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2")}


def encode_routes(routes: np.ndarray) -> tuple[bytes, int, int, int]:
    """int [R, L, k] expert ids -> (bytes, L, k, id bytes), ids 1 byte wide when all < 256.

    Raises:
        ValueError: not 3-D, a negative id or one of 65536 or more.
    """
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise ValueError(f"routes must be [R, L, k]; got shape {routes.shape}")
    if routes.size and (routes.min() < 0 or routes.max() >= 1 << 16):
        raise ValueError(f"expert ids must lie in [0, 65536); got [{routes.min()}, {routes.max()}]")
    width = 1 if not routes.size or routes.max() < 256 else 2
    data = np.ascontiguousarray(routes, dtype=_WIDTH_DTYPE[width]).tobytes()
    return data, int(routes.shape[1]), int(routes.shape[2]), width


def check_routes(where: str, data: bytes, rows: int, layers: int, k: int, width: int) -> None:
    """Check the wire form of a completion's routes against the `rows` it must have
    (prompt + completion tokens - 1; -1: any whole number of rows).

    Empty `data` with layers, k and width 0 is "no routes". Otherwise layers >= 1, k >= 1,
    width 1 or 2 and len(data) == rows * layers * k * width.

    Raises:
        GatewayError: INVALID_ARGUMENT naming `where`, the shape expected and what came.
    """
    if not data and layers == k == width == 0:
        return
    if layers < 1 or k < 1 or width not in _WIDTH_DTYPE:
        raise invalid(
            f"{where}: expected routed_layers >= 1, routed_k >= 1 and routed_id_bytes 1 or 2 "
            f"with routed experts, got {layers}, {k} and {width}"
        )
    row = layers * k * width
    if rows < 0:
        if len(data) % row:
            raise invalid(
                f"{where}: expected routed_experts of whole rows of [{layers} layers, {k}] x "
                f"{width} bytes = {row} bytes, got {len(data)}"
            )
        return
    if len(data) != rows * row:
        raise invalid(
            f"{where}: expected routed_experts of [{rows} tokens (prompt + completion - 1), "
            f"{layers} layers, {k}] x {width} bytes = {rows * row} bytes, got {len(data)}"
        )


def decode_routes(data: bytes, layers: int, k: int, width: int) -> np.ndarray | None:
    """The wire form back to int32 [R, L, k], or None when there are no routes.

    Raises:
        GatewayError: the fields do not describe whole rows (`check_routes`).
    """
    check_routes("routed_experts", data, -1, layers, k, width)
    if not data and layers == 0:
        return None
    ids = np.frombuffer(data, dtype=_WIDTH_DTYPE[width])
    return ids.reshape(-1, layers, k).astype(np.int32)
