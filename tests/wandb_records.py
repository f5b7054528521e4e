"""Read an offline W&B run folder back: the records of its ``run-ID.wandb`` transaction log
(LevelDB's log format, https://github.com/google/leveldb/blob/main/doc/log_format.md, after
W&B's 7-byte header ``:W&B`` + magic 0xBEE1 + version 0), parsed as
``wandb.proto.wandb_internal_pb2.Record``, and its history rows by step. wandb 0.31 ships no
Python reader of its own (the Go core writes the file), so the tests read it here.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _masked_crc_ok(crc: int, kind: int, data: bytes) -> bool:
    """LevelDB's check is CRC-32C; W&B's Go writer uses the IEEE CRC-32 of type + data."""
    return zlib.crc32(bytes([kind]) + data) & 0xFFFFFFFF == crc


def read_records(path: Path) -> list[Any]:
    """Every `Record` of the transaction log at `path`, in write order.

    Raises:
      ValueError: the header is not W&B's, or a chunk's checksum or framing is wrong.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    if not raw.startswith(HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {raw[:7]!r})")
    records, pending, pos = [], b"", len(HEADER)
    while pos + 7 <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's tail is zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0 and length == 0:  # zeroed tail of a preallocated block
            pos += left
            continue
        data = raw[pos + 7 : pos + 7 + length]
        if len(data) != length or not _masked_crc_ok(crc, kind, data):
            raise ValueError(f"{path}: bad chunk at byte {pos} (type {kind}, length {length})")
        pos += 7 + length
        if kind == FULL:
            pending = data
        elif kind == FIRST:
            pending = data
            continue
        elif kind == MIDDLE:
            pending += data
            continue
        elif kind == LAST:
            pending += data
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {pos}")
        record = pb.Record()
        record.ParseFromString(pending)
        records.append(record)
        pending = b""
    return records


def finished_records(run: Path, timeout_s: float = 60.0) -> list[Any]:
    """The records of the run folder's transaction log once its ``exit`` record is there.

    W&B's Go core writes the log from its own process and may still be writing when
    ``run.finish()`` has returned (seen on a loaded CI host: a log without its history rows),
    so this re-reads it every 0.1 s until the last record is ``exit``.

    Raises:
      AssertionError: no complete log within `timeout_s` seconds (the last read's error or
        record kinds in the message).
    """
    deadline, last = time.monotonic() + timeout_s, "no run-*.wandb file"
    while True:
        logs = sorted(run.glob("run-*.wandb"))
        if len(logs) == 1:
            try:
                records = read_records(logs[0])
            except ValueError as e:  # a chunk still being written
                last = str(e)
            else:
                kinds = [r.WhichOneof("record_type") for r in records]
                if kinds and kinds[-1] == "exit":
                    return records
                last = f"records so far: {kinds[-5:]}"
        elif logs:
            last = f"several logs: {logs}"
        if time.monotonic() > deadline:
            raise AssertionError(f"{run}: no finished transaction log after {timeout_s} s ({last})")
        time.sleep(0.1)


def run_folder(wandb_dir: Path) -> Path:
    """The one offline run folder under ``wandb_dir/wandb``.

    Raises:
      AssertionError: none or several.
    """
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"expected one offline run under {wandb_dir}, got {runs}"
    return runs[0]


def history(run: Path) -> dict[int, dict[str, Any]]:
    """step -> {key: value (JSON-decoded)} of the run's history records (rows logged at one
    step merged), read once the log is finished (`finished_records`)."""
    rows: dict[int, dict[str, Any]] = {}
    for record in finished_records(run):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            (i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item
        }
        step = int(items.get("_step", record.history.step.num))
        rows.setdefault(step, {}).update(items)
    return rows


def run_config(run: Path) -> dict[str, Any]:
    """The run's config (the last run record's, keys at the top level, values decoded)."""
    config: dict[str, Any] = {}
    for record in finished_records(run):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            items = record.run.config.update
        elif kind == "config":
            items = record.config.update
        else:
            continue
        for item in items:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config
