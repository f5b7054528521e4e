"""What a trainer process sends of a version when several fan in (`local_shards`): from params
split over 4 CPU devices (FSDP, every param sharded), every engine tensor's sources tile it
exactly once, the blocks are the bf16 HF tensor's regions bit for bit, and in one process all
of them are this process's; whole (replicated) tensors are one block."""

import jax
import numpy as np
import pytest
from ml_dtypes import bfloat16

from mappings.apply import params_to_engine
from mappings.registry import get_family
from models.checkpoints.hf_io import load_hf_checkpoint
from models.params import flat_params
from models.sharding import make_mesh
from trainer.publish.local_shards import blocks_of, engine_arrays, local_blocks
from transport.fan_in import region_of
from transport.manifest import Manifest


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=3)


def test_blocks_of_fsdp_params_tile_every_tensor_and_equal_its_regions(path):
    mesh = make_mesh(fsdp=4, devices=jax.devices()[:4])
    cfg, decoder = load_hf_checkpoint(path, dtype="float32", mesh=mesh, min_shard_bytes=0)
    params = flat_params(decoder)
    family = get_family(cfg.family)
    blocks = local_blocks(engine_arrays(family, cfg, params, "bfloat16"), 7, 0)
    want = dict(params_to_engine(family, cfg, params))
    assert list(blocks.sources) == list(want) and blocks.version == 7
    manifest = Manifest.of(7, [(n, w.shape) for n, w in want.items()], "bfloat16", 1 << 20)
    sources = blocks.sources_for(manifest)
    Manifest(7, manifest.tensors, 1 << 20, senders=2, sources=sources)  # they tile: no error
    split = 0
    for name, w in want.items():
        entry = blocks.sources[name]
        assert all(p == 0 for p, _ in entry)  # one process holds every block
        split += len(entry) == 4
        got = blocks.mine[name]
        assert len(got) == len(entry)
        for (_, box), block in zip(entry, got, strict=True):
            assert block.dtype == bfloat16
            np.testing.assert_array_equal(block, w.astype(bfloat16)[region_of(box)])
    assert split >= len(want) - 2  # all but what cannot split over 4 are in 4 blocks
    assert blocks.num_bytes == sum(w.size * 2 for w in want.values())


def test_a_whole_array_is_one_block_from_the_least_loaded_holder():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    load = {0: 100}
    sources, mine = blocks_of(x, 0, load)  # one process: it holds it, whatever its load
    assert sources == ((0, ((0, 3), (0, 4))),) and load == {0: 148}
    np.testing.assert_array_equal(mine[0], x)
    assert mine[0] is not x  # a host copy, not a view of the caller's buffer
    sources, mine = blocks_of(x, 1, {})  # a process that is not among the holders
    assert sources == ((0, ((0, 3), (0, 4))),) and mine == []
