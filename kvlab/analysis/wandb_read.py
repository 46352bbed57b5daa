"""wandb's offline run files (``<run_dir>/wandb/offline-run-*/run-*.wandb``) read back without a server.

A ``.wandb`` file is wandb's record log: a 7-byte header (``:W&B``, magic, version), then blocks of
32 KiB holding records framed as LevelDB's log frames them (crc32, length, type: full, first,
middle, last), each a ``wandb_internal_pb2.Record``. ``read_run`` keeps what a dashboard groups and
plots by: the run's group, name, tags and job type, its config and its summary values (the last of
each key). kvlab.analysis.sweeps.load_wandb turns a sweep's runs into the table its plots read.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def frames(path: Path):
    """The records' bytes, frames joined."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb run file (no :W&B header)")
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a frame header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind == 1:
            yield body
        elif kind == 2:
            pending = body
        elif kind == 3:
            pending += body
        elif kind == 4:
            yield pending + body
            pending = b""


def _value(item):
    key = item.key or "/".join(item.nested_key)
    try:
        return key, json.loads(item.value_json)
    except ValueError:
        return key, item.value_json


def read_run(path: Path) -> dict:
    """One offline run: ``group``, ``name``, ``tags``, ``job_type``, ``config`` (dotted keys) and ``summary``."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = {"group": None, "name": None, "tags": [], "job_type": None, "config": {}, "summary": {}, "path": str(path)}
    for body in frames(path):
        rec = pb.Record()
        rec.ParseFromString(body)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(group=rec.run.run_group, name=rec.run.display_name, tags=list(rec.run.tags),
                       job_type=rec.run.job_type)
            out["config"].update(dict(_value(i) for i in rec.run.config.update))
        elif kind == "config":
            out["config"].update(dict(_value(i) for i in rec.config.update))
        elif kind == "summary":
            out["summary"].update(dict(_value(i) for i in rec.summary.update))
    out["config"] = {k: (v.get("value", v) if isinstance(v, dict) and set(v) <= {"value", "desc"} else v)
                     for k, v in out["config"].items()}
    return out


def run_files(root: Path) -> list[Path]:
    return sorted(Path(root).rglob("offline-run-*/run-*.wandb"))
