"""The vLLM worker's receiving side: a sharded manifest for another TP degree, or one whose
data-plane rank would carry another TP rank's shards, is refused on the data plane at once (the
sender and the other receivers learn it from the accept vote) instead of leaving the group
waiting for a vote until the transport's timeout."""

import threading
from unittest import mock

import pytest
import torch

from transport.base import TransferError
from transport.config import GlooTransportConfig
from transport.factory import make_receiver, make_sender
from transport.manifest import Manifest, ManifestError

TIMEOUT_S = 6.0


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("tp", "tp_rank", "why"),
    [
        (4, 0, "sharded for tp_size 2, this engine runs tp_size 4"),
        (2, 1, "data-plane rank 1 would receive the shards of another TP rank than this "
               "worker's 1"),
    ],
)  # fmt: skip
def test_sharded_manifest_that_does_not_fit_is_refused_at_once(tp, tp_rank, why):
    import vllm.distributed as vd

    from rollout_engine.vllm.transfer_engine import JaxrlUpdateInfo, JaxrlWeightTransferEngine

    cfg = GlooTransportConfig(port=0, timeout_s=TIMEOUT_S)
    sender = make_sender(cfg, num_receivers=1)
    receiver = make_receiver(cfg.model_copy(update={"port": sender.port}), rank=1, world_size=2)
    joined = [threading.Thread(target=x.connect) for x in (sender, receiver)]
    for t in joined:
        t.start()
    for t in joined:
        t.join(30)
    # the worker half of the engine, without a model (nothing may reach the loaders)
    engine = object.__new__(JaxrlWeightTransferEngine)
    engine.receiver, engine.model, engine.buckets_loaded = receiver, None, 0
    m = Manifest.of(5, [("q", (4, 2))], "float32", 1024).sharded_for(2, {"q": "column"})
    out: dict[str, BaseException] = {}

    def worker() -> None:
        try:
            engine.receive_weights(JaxrlUpdateInfo(manifest=m.to_dict()))
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["worker"] = e

    with (
        mock.patch.object(vd, "get_tensor_model_parallel_world_size", return_value=tp),
        mock.patch.object(vd, "get_tensor_model_parallel_rank", return_value=tp_rank),
    ):
        t = threading.Thread(target=worker)
        t.start()
        with pytest.raises(TransferError) as sent:
            sender.send(m, [("q", torch.zeros(4, 2))])
        t.join(30)
    sender.close()
    receiver.close()
    assert "a receiver refused the manifest of version 5" in str(sent.value), str(sent.value)
    assert isinstance(out["worker"], ManifestError)
    assert why in str(out["worker"])
    assert engine.buckets_loaded == 0
