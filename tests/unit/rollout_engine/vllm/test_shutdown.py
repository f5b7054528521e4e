"""`VllmBackend.shutdown` bounds vLLM's own shutdown by `--vllm-shutdown-s` (1 s): vLLM's
default gives its engine-core process 5 s, which made an idle engine take 6.4 s to end after
SIGTERM on this CPU (3.0 s with 1 s; measured by hand, see the commit)."""

import asyncio

from rollout_engine.cli import make_backend, parse


class RecordingEngine:
    """Stands in for vLLM's AsyncLLM: records the timeout of each shutdown."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def shutdown(self, timeout: float | None = None) -> None:
        self.timeouts.append(timeout)


def _backend(tiny_checkpoint, *flags: str):
    cfg = parse(["--backend", "vllm", "--gateway", "127.0.0.1:1", "--token-file", "t",
                 "--model", str(tiny_checkpoint("llama")), *flags])  # fmt: skip
    return make_backend(cfg)


def test_shutdown_gives_vllm_shutdown_s(tiny_checkpoint):
    for flags, expected in (((), 1.0), (("--vllm-shutdown-s", "0.5"), 0.5)):
        backend = _backend(tiny_checkpoint, *flags)
        engine = backend.engine = RecordingEngine()
        asyncio.run(backend.shutdown())
        assert engine.timeouts == [expected]
        assert backend.engine is None
