"""Packing's cast of a transposed matrix in two passes writes exactly what one strided cast
writes."""

import numpy as np
import torch

from transport.base import as_torch, copy_cast, write_region


def test_a_transposed_matrix_casts_exactly_as_a_strided_copy():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((96, 40)).astype(np.float32)  # [in, out]
    bits = base.view(np.uint32)
    bits[::5] = (bits[::5] & 0xFFFF0000) | 0x8000  # ties: round to nearest even
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        dst = torch.empty(40, 96, dtype=dtype)
        copy_cast(dst, as_torch(base.T))
        want = torch.empty(40, 96, dtype=dtype)
        want.copy_(torch.from_numpy(base).T)  # the strided copy-and-cast
        assert torch.equal(dst, want)
    rows = torch.empty(16, 96, dtype=torch.bfloat16)  # a TP rank's rows of it
    write_region(rows, base.T, (slice(8, 24), slice(0, 96)))
    assert torch.equal(rows, torch.from_numpy(base).T[8:24].to(torch.bfloat16))
