"""An engine process for the elastic-push tests: the worker loop over the harness's fake
backend, which SIGKILLs its own process on bucket `K` of version `V` (argv: gateway address,
engine token, V, K), or with K = -1 once it loaded version `V` (the data plane committed)
and before it acknowledges it. Prints its engine id once registered. Not a test module."""

import asyncio
import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

_path = Path(__file__).parents[1] / "rollout_engine" / "worker_harness.py"
_spec = importlib.util.spec_from_file_location("worker_harness", _path)
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

from gateway.client import GatewayClient  # noqa: E402


class DyingBackend(h.FakeBackend):
    """Dies (SIGKILL, no cleanup) when bucket `at` of version `version` arrives, or with
    `at` = -1 once that version loaded (before the worker acks it "loaded")."""

    def __init__(self, version: int, at: int) -> None:
        super().__init__()
        self.version, self.at = version, at

    async def update_weights(self, manifest):
        if manifest.version == self.version and self.at < 0:
            stats = await super().update_weights(manifest)
            os.kill(os.getpid(), signal.SIGKILL)
            return stats
        if manifest.version == self.version:
            receive, seen = self._receiver.receive, [0]

            def dying_receive(manifest, on_bucket):
                def on(bucket):
                    if seen[0] == self.at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    seen[0] += 1
                    on_bucket(bucket)

                return receive(manifest, on)

            self._receiver.receive = dying_receive
        return await super().update_weights(manifest)


def main() -> None:
    address, token, version, at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = GatewayClient(address, token, margin_s=5.0)
    run = h.WorkerThread(client, DyingBackend(version, at), lease_wait_s=0.2)
    print(run.wait_registered(30.0), flush=True)
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    threading.excepthook = lambda args: None
    asyncio.set_event_loop_policy(None)
    main()
