"""The notebooks run top to bottom (their own cells assert what they show)."""
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def test_notebooks_execute():
    pytest.importorskip("nbmake")
    pytest.importorskip("ipykernel")
    n = len(list(NOTEBOOKS.glob("*.ipynb")))
    assert n >= 3, "notebooks missing"
    # a separate pytest: nbmake collects notebooks only when asked, and a kernel per notebook
    # keeps their state away from this process
    proc = subprocess.run([sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=240", "-q",
                           "-p", "no:cacheprovider", str(NOTEBOOKS)],
                          cwd=NOTEBOOKS.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert f"{n} passed" in proc.stdout, proc.stdout[-2000:]
