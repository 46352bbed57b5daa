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


def test_every_module_is_in_a_layer():
    """The layers contract lists kvlab's packages: a module or package added beside them would be in none, and
    nothing would check what it imports."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: import-linter's own dependency
        import tomli as tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    listed = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    package = ROOT / "kvlab"
    found = {f"kvlab.{p.stem}" for p in package.iterdir()
             if (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
             or (p.is_dir() and (p / "__init__.py").exists())}
    assert found - listed == set(), f"in no layer of pyproject.toml's contract: {sorted(found - listed)}"
    assert listed - found == set(), f"layers that are no module: {sorted(listed - found)}"
    for p in package.iterdir():  # a layer's package says what it holds and what it may import
        if p.is_dir() and (p / "__init__.py").exists():
            assert (p / "__init__.py").read_text().startswith('"""'), f"{p.name}/__init__.py has no docstring"
