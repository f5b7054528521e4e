"""Seconds and GB/s of one weight push through the whole trainer->engine path, without vLLM.

`WeightPublisher.push` (cast in JAX, mapping layout, bucket packing, gloo broadcast) into an
`EngineWorker` whose backend copies every received tensor into its own preallocated buffers
(what a load costs at least), with the real gateway in between, for a random model of
SmolLM2-135M's shape. Reference: a plain memory copy of the same bytes in the same run.
(`benchmarks/weight_sync.py` measures the push into a running vLLM engine.)

    python benchmarks/weight_push.py [--dtype bfloat16] [--bucket-mb 64] [--repeats 3]

Last line: one JSON object with the median push seconds, GB/s, memcpy GB/s and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

import jax
import torch
from common import memcpy_gb_per_s
from flax import nnx
from pydantic import TypeAdapter

from gateway import messages as m
from gateway.client import GatewayClient
from gateway.config import GatewayConfig, RunSettings
from gateway.server import GatewayServer
from models.config import ModelConfig
from models.decoder import Decoder
from rollout_engine.backend import RolloutBackend, UpdateStats
from rollout_engine.config import WorkerConfig
from rollout_engine.worker import EngineWorker
from trainer.publish import WeightPublisher
from transport.base import WeightReceiver
from transport.config import GlooTransportConfig, TransportConfig
from transport.factory import make_receiver

SMOLLM2_135M = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}
TOKENS = {"trainer": "trainer-token-0123456789", "engine": "engine-token-0123456789"}


class SinkBackend(RolloutBackend):
    """Receives versions into preallocated tensors; generates nothing."""

    def __init__(self) -> None:
        self._version: int | None = 0
        self._receiver: WeightReceiver | None = None
        self.store: dict[str, torch.Tensor] = {}

    @property
    def weight_version(self) -> int | None:
        return self._version

    async def start(self) -> None:
        return None

    async def generate(self, prompt, stop_strings=()):
        raise NotImplementedError("the sink only receives weights")

    async def connect_transport(
        self, transport: dict, rank_offset: int = 1, world_size: int | None = None
    ) -> None:
        cfg = TypeAdapter(TransportConfig).validate_python(transport)
        world = world_size if world_size is not None else rank_offset + 1
        self._receiver = make_receiver(cfg, rank=rank_offset, world_size=world)
        connect = getattr(self._receiver, "connect", None)  # collective kinds join a group
        if connect is not None:
            await asyncio.to_thread(connect)

    async def update_weights(self, manifest) -> UpdateStats:
        t0 = time.perf_counter()

        def load(bucket) -> None:
            for name, tensor in bucket:
                if name not in self.store:
                    self.store[name] = torch.empty_like(tensor)
                self.store[name].copy_(tensor)

        if self._receiver is None:
            raise RuntimeError("update_weights before connect_transport")
        await asyncio.to_thread(self._receiver.receive, manifest, load)
        self._version = manifest.version
        dt = time.perf_counter() - t0
        return UpdateStats(manifest.version, manifest.total_bytes, 0.0, dt)

    async def shutdown(self) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = ModelConfig.from_hf(SMOLLM2_135M, dtype="float32")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    server = GatewayServer(
        GatewayConfig(settings=RunSettings(model_family="llama")), TOKENS
    ).start()
    trainer = GatewayClient(server.address, TOKENS["trainer"])
    engine = GatewayClient(server.address, TOKENS["engine"])
    spec = m.EngineSpec("jax", "llama", args.dtype, ("gloo",))
    worker = EngineWorker(engine, SinkBackend(), spec, WorkerConfig())
    thread = threading.Thread(target=lambda: asyncio.run(worker.run()), daemon=True)
    thread.start()
    while not worker.engine_id:
        time.sleep(0.01)
    transport = GlooTransportConfig(port=0, timeout_s=300, bucket_bytes=args.bucket_mb << 20)
    publisher = WeightPublisher(trainer, transport, "llama", cfg, args.dtype)
    pushes = [publisher.push(model, version=v + 1) for v in range(args.repeats)]
    trainer.shutdown()
    thread.join(30)
    publisher.close()
    server.stop(0)

    num_bytes = pushes[0].num_bytes
    seconds = statistics.median(p.seconds for p in pushes)
    send_s = statistics.median(p.send_s for p in pushes)
    reference = memcpy_gb_per_s(num_bytes, args.repeats)
    for p in pushes:
        print(f"version {p.version}: {p.seconds:.3f} s (ready {p.ready_s:.3f}, send "
              f"{p.send_s:.3f}, loaded {p.loaded_s:.3f}); {p.gb_per_s:.3f} GB/s")  # fmt: skip
    result = {
        "model": "random SmolLM2-135M shape",
        "dtype": args.dtype,
        "bucket_mb": args.bucket_mb,
        "bytes": num_bytes,
        "push_s": round(seconds, 4),
        "push_gb_per_s": round(num_bytes / seconds / 1e9, 4),
        "send_gb_per_s": round(num_bytes / send_s / 1e9, 4),
        "memcpy_gb_per_s": round(reference, 4),
        "ratio_vs_memcpy": round(num_bytes / seconds / 1e9 / reference, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
