"""The package's import contracts (pyproject.toml, [tool.importlinter]) hold for this checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_layers_hold_and_no_module_imports_in_a_cycle():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: install the dev extra (pip install -e '.[dev]')")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([exe, str(ROOT / "pyproject.toml")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "2 kept, 0 broken" in p.stdout, p.stdout[-2000:]
