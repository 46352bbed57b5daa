"""The notebooks run top to bottom (their own cells assert what they show)."""
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # as long as the longest notebook may take; each nbmake run is bounded as well
def test_notebooks_execute():
    pytest.importorskip("nbmake")
    pytest.importorskip("ipykernel")
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert len(paths) >= 3, "notebooks missing"
    # one nbmake run per notebook, all at once: a notebook mostly waits for the rank processes
    # it starts, so on two cores they take little longer together than the longest alone
    procs = {p.name: subprocess.Popen([sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=600", "-q",
                                       "-p", "no:cacheprovider", str(p)],
                                      cwd=NOTEBOOKS.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for p in paths}
    failed = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=1200)
        if proc.returncode != 0 or "1 passed" not in out:
            failed[name] = out[-4000:]
    assert not failed, "\n\n".join(f"{name}:\n{out}" for name, out in failed.items())
