"""The notebooks run top to bottom (their own cells assert what they show)."""
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # all notebooks in turn; each nbmake run is bounded as well
def test_notebooks_execute():
    pytest.importorskip("nbmake")
    pytest.importorskip("ipykernel")
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert len(paths) >= 3, "notebooks missing"
    # one nbmake run per notebook, one after another: kernels started together race for the TCP
    # ports jupyter picks (bind to port 0, close, hand it to the kernel), and a lost race kills the
    # kernel before its first cell ("Address already in use")
    failed = {}
    for p in paths:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=600", "-q",
                               "-p", "no:cacheprovider", "-n", "0", str(p)],
                              cwd=NOTEBOOKS.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=900)
        if proc.returncode != 0 or "1 passed" not in proc.stdout:
            failed[p.name] = proc.stdout[-4000:]
    assert not failed, "\n\n".join(f"{name}:\n{out}" for name, out in failed.items())
