"""Weights through a shared folder: one safetensors file per bucket, for engines that share
only a filesystem with the trainer.

Layout: `<root>/v<version:010d>/fingerprint` (the manifest's `Manifest.fingerprint`: the
manifest itself comes with the sync plan) and `bucket_<i:05d>.safetensors`. The sender
writes into a hidden temporary folder and renames it into place when every bucket is on
disk: the rename is the commit, so a receiver never sees part of a version. The sender keeps
the newest `keep` versions and deletes older ones.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transport.base import (
    OnBucket,
    SendStats,
    TransferError,
    WeightReceiver,
    WeightSender,
    as_torch,
)
from transport.manifest import Manifest, ManifestError

FINGERPRINT = "fingerprint"
"""The file of a version folder holding its manifest's fingerprint."""


def version_dir(root: str | os.PathLike, version: int) -> Path:
    """The committed folder of `version` under `root`."""
    return Path(root) / f"v{version:010d}"


def commit_folder(tmp: Path, final: Path) -> None:
    """Commit a version written into the hidden folder `tmp`: rename it to `final` (one
    rename, so a receiver sees all of the version or none; a folder already there, from an
    earlier try at the same version, is replaced)."""
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)


def wait_committed(root: str | os.PathLike, version: int, timeout_s: float, poll_s: float) -> Path:
    """The folder of `version` once committed (its fingerprint file is there).

    Raises:
        TransferError: not committed within `timeout_s` seconds.
    """
    d = version_dir(root, version)
    wait_path(d / FINGERPRINT, timeout_s, poll_s, f"version {version}")
    return d


def wait_path(path: Path, timeout_s: float, poll_s: float, what: str) -> None:
    """Return once `path` exists (a sender's commit), looking every `poll_s` seconds.

    Raises:
        TransferError: "`what` not committed within `timeout_s` s (`path` absent)".
    """
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TransferError(f"{what} not committed within {timeout_s} s ({path} absent)")
        time.sleep(poll_s)


class FolderSender(WeightSender):
    """A sender that leaves each version in a folder its receivers poll (the file,
    delta-file and shared-memory transports), committing it by a rename.

    Args:
        root: the folder (created if absent).
        keep: how many committed versions to keep (>= 1).

    Raises:
        ValueError: `keep` < 1.
    """

    def __init__(self, root: str | os.PathLike, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)


class FileSender(FolderSender):
    """Writes each version under `root` as one safetensors file per bucket (see
    `FolderSender`)."""

    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, Any]]) -> SendStats:
        """See `WeightSender.send`. Returns once the version's folder is committed."""
        import torch
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        final = version_dir(self.root, manifest.version)
        tmp = self.root / f".tmp-v{manifest.version:010d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            it = iter(tensors)
            buckets = manifest.buckets()
            for b, bucket in enumerate(buckets):
                out = {}
                for i in bucket:
                    spec = manifest.tensors[i]
                    name, arr = next(it, (None, None))
                    if name != spec.name:
                        raise ManifestError(
                            f"tensor {i}: got {name!r}, manifest says {spec.name!r}"
                        )
                    t = as_torch(arr)
                    if tuple(t.shape) != spec.shape:
                        raise ManifestError(
                            f"{name}: shape {list(t.shape)}, manifest says {list(spec.shape)}"
                        )
                    out[name] = t.to(getattr(torch, spec.dtype)).contiguous().cpu()
                save_file(out, str(tmp / f"bucket_{b:05d}.safetensors"))
            extra = next(it, None)
            if extra is not None:
                raise ManifestError(f"more tensors than the manifest lists: {extra[0]!r}")
            (tmp / FINGERPRINT).write_bytes(manifest.fingerprint())
            commit_folder(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        committed = sorted(p for p in self.root.iterdir() if p.name.startswith("v"))
        for old in committed[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return SendStats(
            manifest.version, manifest.total_bytes, len(buckets), time.perf_counter() - t0
        )


class FolderReceiver(WeightReceiver):
    """A receiver that waits for each version to be committed under a folder it polls (the
    file, delta-file and shared-memory transports).

    Args:
        root: the sender's folder.
        timeout_s: how long `receive` waits for the version to be committed.
        poll_s: seconds between looks.
    """

    def __init__(self, root: str | os.PathLike, timeout_s: float = 300.0, poll_s: float = 0.05):
        self.root = Path(root)
        self.timeout_s = timeout_s
        self.poll_s = poll_s


class FileReceiver(FolderReceiver):
    """Waits for a committed version folder under `root` (see `FolderReceiver`) and loads it
    bucket by bucket."""

    def receive(self, manifest: Manifest, on_bucket: OnBucket) -> None:
        """See `WeightReceiver.receive`."""
        from safetensors.torch import load_file

        d = wait_committed(self.root, manifest.version, self.timeout_s, self.poll_s)
        try:
            manifest.check_offered((d / FINGERPRINT).read_bytes())
        except ManifestError as e:
            raise ManifestError(f"{d}: {e}") from None
        for b, bucket in enumerate(manifest.buckets()):
            try:
                loaded = load_file(str(d / f"bucket_{b:05d}.safetensors"))
            except (OSError, ValueError) as e:  # deleted by a newer version, or corrupt
                raise TransferError(f"reading bucket {b} of version {manifest.version}: {e}") from e
            names = [manifest.tensors[i].name for i in bucket]
            if sorted(loaded) != sorted(names):
                raise TransferError(f"bucket {b} of version {manifest.version} holds wrong names")
            try:
                on_bucket([(n, loaded[n]) for n in names])
            except Exception as e:
                raise TransferError(f"loading version {manifest.version} failed: {e!r}") from e
