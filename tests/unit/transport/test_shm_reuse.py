"""Shared-memory segments rewritten in place: a retired segment no engine holds takes the next
version (same file, no fresh pages); one an engine still holds, alive or not yet moved on, is
never touched; a version larger than the retired segment grows it; a dead engine's hold goes
with it."""

import os
import subprocess
import sys

import pytest
import torch

from transport.base import TransferError
from transport.config import ShmTransportConfig
from transport.factory import make_receiver, make_sender
from transport.manifest import Manifest
from transport.shm import segment_path
from transport.shm_lease import claim_retired


def _w(seed, rows=64):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(rows, 16, generator=g), "b": torch.randn(16, 3, generator=g).T}


def _m(version, rows=64):
    return Manifest.of(version, [("a", (rows, 16)), ("b", (3, 16))], "bfloat16", 1024)


def _load(receiver, manifest):
    got: dict[str, torch.Tensor] = {}
    receiver.receive(manifest, lambda bucket: got.update((n, t.clone()) for n, t in bucket))
    return got


def _exact(got, w):
    return set(got) == set(w) and all(torch.equal(got[n], w[n].bfloat16()) for n in w)


def test_a_retired_segment_takes_the_next_version_once_the_engine_moved_on(tmp_path):
    cfg = ShmTransportConfig(root=str(tmp_path / "shm"), timeout_s=5, keep=2)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    inodes = {}
    for v in (1, 2, 3, 4):
        sender.send(_m(v), _w(v).items())
        inodes[v] = segment_path(cfg.root, v).stat().st_ino
        assert _exact(_load(receiver, _m(v)), _w(v))
    # v1, v2 fresh; v3 rewrote v1's segment (the engine had loaded v2 and let v1 go), v4 v2's
    assert (inodes[3], inodes[4]) == (inodes[1], inodes[2]) and sender.reused == 2
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == ["v0000000003.seg",
                                                                     "v0000000004.seg"]  # fmt: skip
    receiver.close()
    sender.close()
    assert not (tmp_path / "shm").exists()


def test_a_segment_an_engine_still_holds_is_never_rewritten(tmp_path):
    cfg = ShmTransportConfig(root=str(tmp_path / "shm"), timeout_s=5, keep=2)
    sender, fast, slow = make_sender(cfg), make_receiver(cfg), make_receiver(cfg)
    sender.send(_m(1), _w(1).items())
    views: list = []
    slow.receive(_m(1), views.extend)  # a loader that keeps the views of version 1
    assert _exact(_load(fast, _m(1)), _w(1))
    ino1 = segment_path(cfg.root, 1).stat().st_ino
    for v in (2, 3):
        sender.send(_m(v), _w(v).items())
        assert _exact(_load(fast, _m(v)), _w(v))
    # `slow` still holds version 1: version 3 went to a fresh segment, v1's bytes stay as sent
    assert segment_path(cfg.root, 3).stat().st_ino != ino1 and sender.reused == 0
    assert all(torch.equal(t, _w(1)[n].bfloat16()) for n, t in views)
    slow.close()
    sender.send(_m(4), _w(4).items())  # now v2's segment is free (`fast` moved on to v3)
    assert sender.reused == 1 and _exact(_load(fast, _m(4)), _w(4))
    for end in (fast, sender):
        end.close()


def test_a_version_larger_than_the_retired_segment_grows_it(tmp_path):
    cfg = ShmTransportConfig(root=str(tmp_path / "shm"), timeout_s=5, keep=1)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    sender.send(_m(1, rows=8), _w(1, rows=8).items())
    assert _exact(_load(receiver, _m(1, rows=8)), _w(1, rows=8))
    small = segment_path(cfg.root, 1).stat().st_size
    receiver.close()  # keep=1: the only segment, free once the engine lets go
    sender.send(_m(2, rows=512), _w(2, rows=512).items())
    seg = segment_path(cfg.root, 2).stat()
    assert sender.reused == 1 and seg.st_size > small
    assert _exact(_load(receiver, _m(2, rows=512)), _w(2, rows=512))
    receiver.close()
    sender.send(_m(3, rows=8), _w(3, rows=8).items())  # and shrinks it back
    assert segment_path(cfg.root, 3).stat().st_size == small
    assert _exact(_load(receiver, _m(3, rows=8)), _w(3, rows=8))
    receiver.close()
    sender.close()


def test_a_dead_engines_hold_goes_with_it(tmp_path):
    seg = tmp_path / "v.seg"
    seg.write_bytes(b"x" * 4096)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(seg)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH)\n"
         "print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert claim_retired(seg, tmp_path / "tmp") is None and seg.exists()
        holder.kill()
        holder.wait(10)
        fd = claim_retired(seg, tmp_path / "tmp")
        assert fd is not None and not seg.exists() and (tmp_path / "tmp").exists()
        os.close(fd)
    finally:
        holder.kill()
        holder.wait(10)


def test_an_engine_asking_for_a_rewritten_version_gets_a_clear_error(tmp_path):
    cfg = ShmTransportConfig(root=str(tmp_path / "shm"), timeout_s=5, keep=2)
    sender, receiver = make_sender(cfg), make_receiver(cfg)
    for v in (1, 2, 3):  # v3 goes into v1's segment
        sender.send(_m(v), _w(v).items())
        _load(receiver, _m(v))
    late = make_receiver(cfg.model_copy(update={"timeout_s": 0.5}))
    with pytest.raises(TransferError, match="version 1"):
        late.receive(_m(1), lambda bucket: None)
    assert sender.reused == 1 and _exact(_load(receiver, _m(3)), _w(3))  # v3 intact
    for end in (late, receiver, sender):
        end.close()


def _mapped_segments(root) -> list[str]:
    """The lines of /proc/self/maps that map a file under `root` (deleted ones included)."""
    return [line for line in open("/proc/self/maps") if str(root) in line]


def test_the_sender_packs_a_rewrite_into_the_mapping_it_kept_and_unmaps_what_it_unlinks(tmp_path):
    cfg = ShmTransportConfig(root=str(tmp_path / "shm"), timeout_s=5, keep=2)
    sender, receiver, slow = make_sender(cfg), make_receiver(cfg), make_receiver(cfg)
    maps = []
    for v in (1, 2, 3, 4):
        sender.send(_m(v), _w(v).items())
        maps.append({id(k.mm) for k in sender._maps.values()})
        assert _exact(_load(receiver, _m(v)), _w(v))
    # v3 and v4 went into v1's and v2's segments through the very mappings v1 and v2 made
    assert sender.reused == 2 and maps[3] == maps[1] and len(maps[3]) == 2
    receiver.close()
    receiver = make_receiver(cfg)
    views: list = []
    slow.receive(_m(4), views.extend)  # an engine holds v4: v5 goes fresh, v3's is unlinked
    for v in (5, 6):
        sender.send(_m(v), _w(v).items())
        assert _exact(_load(receiver, _m(v)), _w(v))
    assert len(sender._maps) == 2  # never more mappings than kept segments
    held = [line for line in _mapped_segments(cfg.root) if "(deleted)" in line]
    # the only unlinked segment still mapped is v4's, by the engine that holds it
    assert len(held) == 1 and all(torch.equal(t, _w(4)[n].bfloat16()) for n, t in views)
    del views
    for end in (slow, receiver, sender):
        end.close()
    import gc

    gc.collect()
    assert _mapped_segments(cfg.root) == []  # close unmaps everything the sender kept
