"""A wheel runs: built from the sources, installed where the checkout cannot be imported, ``kvlab run`` verifies
and ``kvlab plan`` plans.

The wheel is built from a copy of the sources (a stale ``build/`` in the checkout would otherwise be packed too)
and installed into a fresh venv whose only view of this environment is a ``.pth`` line to its site-packages, for
torch and the other dependencies; a ``.pth`` file found through such a line is not run, so the checkout's
editable install stays out of sight.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import kvlab

pytestmark = pytest.mark.slow

CHECKOUT = Path(kvlab.__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "kvlab", "conf", "kernels", "traces")


def _call(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{argv}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the fresh venv's bin directory, a working directory outside the checkout, the environment to run in)."""
    root = tmp_path_factory.mktemp("wheel")
    src, dist, venv, cwd = root / "src", root / "dist", root / "venv", root / "cwd"
    src.mkdir()
    for name in SOURCES:
        path = CHECKOUT / name
        if path.is_dir():
            # kvlab/_data's links are relative, so they point at the copied conf/, kernels/ and traces/
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.exists():
            shutil.copy2(path, src / name)
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    _call([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
          cwd=cwd, env=env, timeout=240)
    wheel, = dist.glob("kvlab-*.whl")
    _call([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=cwd, env=env, timeout=120)
    python = venv / "bin" / "python"
    site = Path(_call([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                      cwd=cwd, env=env, timeout=60).stdout.strip())
    (site / "kvlab_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _call([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)],
          cwd=cwd, env=env, timeout=240)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv / "bin", cwd, env


def test_the_installed_package_finds_its_data_inside_itself(installed):
    bin_dir, cwd, env = installed
    out = _call([str(bin_dir / "python"), "-c",
                 "import json, kvlab, kvlab.core.paths as p; print(json.dumps([kvlab.__file__, str(p.CONF_DIR), "
                 "str(p.KERNELS_DIR), str(p.TRACES_DIR)]))"], cwd=cwd, env=env, timeout=120)
    package, conf, kernels, traces = (Path(s) for s in json.loads(out.stdout))
    venv = bin_dir.parent.resolve()
    for path in (package, conf, kernels, traces):
        assert path.resolve().is_relative_to(venv), path
        assert not path.resolve().is_relative_to(CHECKOUT), path
    # every group of the checkout, including ones added after this test was written, ships
    assert sorted(p.name for p in conf.iterdir() if p.is_dir()) == \
        sorted(p.name for p in (CHECKOUT / "conf").iterdir() if p.is_dir())
    assert {p.name for p in (CHECKOUT / "kernels").glob("*.cu")} <= {p.name for p in kernels.glob("*.cu")}
    assert (traces / "README.md").is_file()


def test_kvlab_run_verifies_from_the_wheel(installed):
    bin_dir, cwd, env = installed
    run_dir = cwd / "run"
    out = _call([str(bin_dir / "kvlab"), "run", f"hydra.run.dir={run_dir}", "logger=quiet"], cwd=cwd, env=env,
                timeout=240)
    assert "verified" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verified"] and summary["requests"] == 4


def test_kvlab_plan_from_the_wheel(installed):
    bin_dir, cwd, env = installed
    plan_dir = cwd / "plan"
    out = _call([str(bin_dir / "kvlab"), "plan", f"hydra.run.dir={plan_dir}"], cwd=cwd, env=env, timeout=180)
    assert "total" in out.stdout
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert plan["total_bytes"] > 0 and plan["pairs"]
