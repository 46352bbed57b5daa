"""transport=nixl and its reference: raw NIXL WRITEs between processes over UCX (DRAM on CPUs)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13", reason='the nixl extra is not installed (pip install -e ".[nixl]")')

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("writers", [1, 2])
def test_raw_write_one_and_many_descriptors_verified(writers, tmp_path):
    """The benchmark's reference itself: the bytes land where the shuffled descriptors say, on the target."""
    out = tmp_path / "raw.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "nixl_raw.py"), "--mib", "1", "--descs", "1", "64",
                    "--writers", str(writers), "--out", str(out)], check=True, timeout=240)
    report = json.loads(out.read_text())
    assert report["nixl"] and report["ucx"]
    rows = report["cases"]
    assert [(r["bytes"], r["descriptors"], r["piece_bytes"]) for r in rows] == [
        (1 << 20, writers, (1 << 20) // writers), (1 << 20, 64, 1 << 14)]
    assert all(r["verified"] and r["seconds"] > 0 for r in rows), rows
