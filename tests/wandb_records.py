"""Read what W&B 0.31 wrote into an offline run (`<dir>/wandb/offline-run-*/run-*.wandb`), for tests.

The file is W&B's record log (a 7-byte header, then 32 KiB blocks of records, each a
7-byte header -- crc32, length, type full/first/middle/last -- and its bytes) whose
records are `wandb_internal_pb2.Record` protobufs. Only what the tests need is decoded:
the run record (id, rewind point `branch_point`) and the step of every history row.
"""

from __future__ import annotations

import struct
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


def read_offline_run(run_dir: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    out = OfflineRun()
    for data in _records(next(Path(run_dir).glob("*.wandb"))):
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.run_id = rec.run.run_id
            if rec.run.HasField("branch_point"):
                out.branch_run, out.branch_step = rec.run.branch_point.run, rec.run.branch_point.value
        elif kind == "history":
            out.steps.append(int(rec.history.step.num))
    return out
