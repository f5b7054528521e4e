"""A trainer stand-in for the vLLM integration tests, run as its own process.

Binds a gloo sender on a free port, prints `port <N>`, joins the group, then serves commands
read from stdin, one per line:
    send <model_dir> <version> <bucket_bytes>
    send_broken <model_dir> <version> <bucket_bytes>   (renames one tensor, reshapes another)
    send_partial <model_dir> <version> <bucket_bytes>  (dies after half the tensors went out)
For each it prints `manifest <json>` before sending and `done <json>` or `error <message>`.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file

from transport.base import TransferError
from transport.gloo import GlooSender
from transport.manifest import Manifest


def _say(*parts: str) -> None:
    print(*parts, flush=True)


def _dying(tensors, n):
    """Yield the first `n` tensors, then kill this process (a trainer crashing mid-update)."""
    yield from tensors[:n]
    _say("dying")
    os._exit(3)


def main() -> None:
    sender = GlooSender("127.0.0.1", 0, num_receivers=1, timeout_s=120)
    _say("port", str(sender.port))
    sender.connect()
    for line in sys.stdin:
        cmd, model_dir, version, bucket_bytes = line.split()
        state = load_file(f"{model_dir}/model.safetensors")
        if cmd == "send_broken":
            names = list(state)
            state["model.layers.0.self_attn.not_a_proj.weight"] = state.pop(names[1])
            state[names[2]] = torch.zeros(3, 5)
        tensors = list(state.items())
        m = Manifest.of(
            int(version), [(n, tuple(t.shape)) for n, t in tensors], "float32", int(bucket_bytes)
        )
        _say("manifest", json.dumps(m.to_dict()))
        source = _dying(tensors, len(tensors) // 2) if cmd == "send_partial" else tensors
        try:
            stats = sender.send(m, source)
            _say(
                "done",
                json.dumps(
                    {
                        "version": stats.version,
                        "buckets": stats.num_buckets,
                        "bytes": stats.num_bytes,
                        "seconds": stats.seconds,
                    }
                ),
            )
        except TransferError as e:
            _say("error", str(e).replace("\n", " "))


if __name__ == "__main__":
    main()
