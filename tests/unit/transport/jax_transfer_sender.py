"""A trainer-like sender process for `test_jax_transfer.py`: serves its blocks of the test's
weights through `transport.jax_transfer`, each block on one of its 2 CPU devices in turn.

Usage: python jax_transfer_sender.py RANK VERSIONS (comma-separated); prints its server's
address on stdout, serves every listed version to receiver rank 2 of group 0, then waits until
stdin closes.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402

from tests.unit.transport.test_jax_transfer import RECEIVER, blocks, manifest, weights  # noqa: E402
from transport.jax_transfer import JaxTransferSender  # noqa: E402


def main() -> None:
    rank, versions = int(sys.argv[1]), [int(v) for v in sys.argv[2].split(",")]
    sender = JaxTransferSender("127.0.0.1", 60.0, rank, (RECEIVER,), 0)
    devices = jax.local_devices()
    w = weights()
    for v in versions:
        m = manifest(w, v)
        items = [(n, [jax.device_put(b, devices[k % len(devices)]) for k, b in enumerate(bs)])
                 for n, bs in blocks(w, m, rank)]  # fmt: skip
        sender.send(m, items)
    print(sender.address, flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
