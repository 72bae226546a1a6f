"""Read what W&B 0.31 wrote into an offline run (`<dir>/wandb/offline-run-*/run-*.wandb`), for tests.

The file is W&B's record log (a 7-byte header, then 32 KiB blocks of records, each a
7-byte header -- crc32, length, type full/first/middle/last -- and its bytes) whose
records are `wandb_internal_pb2.Record` protobufs. Only what the tests need is decoded:
the run record (id, rewind point `branch_point`), the step of every history row and its values.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

HEADER, BLOCK, RECORD_HEADER = 7, 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path):
    data, pos, pending = path.read_bytes(), HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER:
            pos += left  # block trailer
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + RECORD_HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + RECORD_HEADER:pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


@dataclass
class OfflineRun:
    run_id: str = ""
    branch_run: str = ""
    branch_step: float | None = None
    steps: list[int] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    """Each history row's values, key -> the value W&B recorded, JSON-decoded; a nested value is
    flattened by W&B into one item per field (a histogram: `<key>/_type`, `<key>/values`, `<key>/bins`)."""
    exited: bool = False
    """The run's `exit` record (its last) is in the file."""


def read_offline_run(run_dir: Path, timeout_s: float = 120.0) -> OfflineRun:
    """The run as recorded, once W&B has written its `exit` record: W&B's core process writes the file
    on its own, and `run.finish()` can return before the last block is on disk (under load a run read
    at once had its run record and none of its history rows). `timeout_s` is a failsafe only."""
    deadline = time.monotonic() + timeout_s
    while not (out := _read_once(run_dir)).exited and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.exited, f"W&B never finished writing {run_dir} (no exit record after {timeout_s:g}s)"
    return out


def _read_once(run_dir: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    out = OfflineRun()
    for data in _records(next(Path(run_dir).glob("*.wandb"))):
        rec = pb.Record()
        try:
            rec.ParseFromString(data)
        except Exception:  # noqa: BLE001 - a record cut by a write still in progress: read again later
            break
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.run_id = rec.run.run_id
            if rec.run.HasField("branch_point"):
                out.branch_run, out.branch_step = rec.run.branch_point.run, rec.run.branch_point.value
        elif kind == "history":
            out.steps.append(int(rec.history.step.num))
            out.rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
        elif kind == "exit":
            out.exited = True
    return out
