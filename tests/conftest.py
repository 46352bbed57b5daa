"""What several test files share: running the real ``kvlab`` command line.

``kvlab_cli("run", "hydra.run.dir=...", cwd=tmp_path)`` runs the console script the package
installs (``python -m kvlab`` where there is none), ``torchrun=[...]`` the same command under
``torch.distributed.run``; both return the finished process with its stdout and stderr as text.
``kvlab_cli.argv(...)`` is the command line alone, for tests that start several processes at once;
``kvlab_cli.ranks(dirs)`` starts the rank processes themselves, without a launcher.

``pytest -m "not slow"`` is the loop a developer runs every few minutes: there the property
tests draw a tenth of their examples (Hypothesis profile ``quick``); a run without that
marker expression, as in CI, or with an explicit ``--hypothesis-profile``, draws them all.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

# how a request lost with a killed ctx1 (world rank 1) is named: the chunk that failed on the rank that
# gave up (or failed after another of its own), the launcher stopping a rank still waiting on the dead one,
# or what the gen rank received before the run stopped
LOST_TO_CTX1 = (r"(gen0|ctx0): (aborted after )?request \d+ (chunk \d+ )?with (ctx0|ctx1|gen0): "
                r"|(ctx0|gen0): stopped by SIGTERM after ctx1 \(rank 1\) died"
                r"|gen0 received \d+ of 14 chunks \(run stopped: ctx1 \(rank 1\) sent no report")
# gen0's first error when ctx1 died while gen0 waited on a chunk of ctx0's (held at their tensor-parallel barrier):
# the wait runs out and names the dead rank, or the launcher stops gen0 first, naming it too
GEN0_NAMES_DEAD_CTX1 = (r"gen0: (request \d+ chunk \d+ with ctx0: .*; ctx1 \(rank 1\) had died"
                        r"|stopped by SIGTERM after ctx1 \(rank 1\) died)")

# for end-to-end runs drawn from a matrix (each example is a run of its own processes): no deadline, fixtures
# shared by the examples (each makes its own directory), and no shrinking (a failing case is printed as drawn;
# shrinking would run it again many times)
E2E = dict(deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.reuse, Phase.generate])

# the tests scale their max_examples by the profile's share of Hypothesis' default of 100
settings.register_profile("quick", max_examples=10)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fuzzers' longer budgets (marker ``fuzz``) run only when asked for (``pytest -m fuzz``): the default
    suite keeps their quick draws. The GPU tests run in one pytest-xdist worker (``--dist loadgroup``, the
    default's): one after another, as on a machine of one GPU they always have, unless ``--dist load`` spreads
    them (scripts/gpu_check.sh --jobs N)."""
    fuzz = "fuzz" in (config.getoption("markexpr") or "")
    skip = pytest.mark.skip(reason="the fuzzers' longer budget: pytest -m fuzz runs it")
    for item in items:
        if item.get_closest_marker("fuzz") and not fuzz:
            item.add_marker(skip)
        if item.get_closest_marker("gpu") or item.get_closest_marker("gpu2"):
            item.add_marker(pytest.mark.xdist_group("gpu"))


def pytest_configure(config: pytest.Config) -> None:
    if "not slow" in (config.getoption("markexpr") or "") and config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("quick")


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_sessions_directory(tmp_path_factory):
    """What the tests' processes leave in their temporary directory (torchrun's agent keeps a torchelastic_*
    directory per run; a run the test kills leaves its ranks' scratch) goes under pytest's own base directory,
    which pytest prunes, instead of piling up in /tmp."""
    import tempfile

    scratch = tmp_path_factory.mktemp("tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = str(scratch), None
    yield
    if before is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture
def own_shm():
    """A directory of the test's own in /dev/shm, for ``transport.shm_dir``: what a run leaves there is its own,
    whatever other runs on the machine (another pytest-xdist worker's) hold in /dev/shm meanwhile."""
    import shutil
    import tempfile

    from kvlab.transports.ipc import SHM_DIR

    if not os.path.isdir(SHM_DIR):
        pytest.skip(f"no {SHM_DIR} here")
    d = Path(tempfile.mkdtemp(dir=SHM_DIR, prefix="kvlab-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def kvlab_argv(*args: str, torchrun: list[str] | None = None) -> list[str]:
    """The argv of ``kvlab ARGS``, or of torchrun's agent starting ``python -m kvlab ARGS`` per rank."""
    if torchrun is not None:
        return [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", "kvlab", *args]
    script = Path(sys.executable).parent / "kvlab"
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "kvlab", *args]


def _run(*args: str, cwd: Path | str | None = None, timeout: float = 180, torchrun: list[str] | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``kvlab ARGS`` to the end; ``env`` adds to this process's environment."""
    return subprocess.run(kvlab_argv(*args, torchrun=torchrun), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **env) if env else None)


def _ranks(run_dirs: list[Path], timeout: float = 120,
           env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Start ``python -m kvlab.cli.worker DIR`` once per entry as the ranks of one job, as torchrun would
    (rank i reads ``run_dirs[i]/config.yaml``, so ranks may be given different configs), and wait for all."""
    from kvlab.cli.launch import reserve_port

    with reserve_port() as reserved:
        port, world = reserved.getsockname()[1], len(run_dirs)
        procs = [subprocess.Popen([sys.executable, "-m", "kvlab.cli.worker", str(d)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env or {})))
                 for rank, d in enumerate(run_dirs)]
        outs = [p.communicate(timeout=timeout) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]


class KvlabCLI:
    argv = staticmethod(kvlab_argv)
    __call__ = staticmethod(_run)
    ranks = staticmethod(_ranks)


@pytest.fixture
def no_ranks(monkeypatch):
    """The launcher's start of the ranks, replaced: what it would have started, and with which config."""
    import yaml

    from kvlab.cli.launch import Outcome

    started = []

    def launch_local(run_dir, world_size, **kw):
        started.append(yaml.safe_load(kw["config_yaml"]))
        return Outcome(0)

    monkeypatch.setattr("kvlab.cli.run_cmd.launch_local", launch_local)
    return started


@pytest.fixture
def kvlab_cli() -> KvlabCLI:
    return KvlabCLI()


def script_module(name: str):
    """``scripts/<name>.py``, which is no package's module, imported once under its own name (dataclasses look
    their module up in ``sys.modules``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" /
                                                      f"{name}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def check_figures(run_dir: Path | str, importable: Path | str | None = None) -> None:
    """A finished run's files obey the identities of kvlab.core.figures (kvlab.results.metrics.violations: TTFT =
    queue +
    prefill + exposed, exposed and time in flight within the transfer span, the run's time in flight within
    its span), and every rank moved the bytes the plan its config makes says (kvlab.config.workload.plan_run).
    ``importable``: a directory the run's config imports from (a user's strategy module)."""
    from omegaconf import OmegaConf

    from kvlab.config.schema import Config, build
    from kvlab.config.workload import plan_run
    from kvlab.results import metrics, records

    run_dir = Path(run_dir)
    parts = [p for f in sorted((run_dir / "parts").glob("rank*.json"))
             for p in records.read_part(run_dir, int(f.stem.removeprefix("rank"))).parts]
    segments, pulls = None, False
    if (run_dir / "config.yaml").exists():
        schema = OmegaConf.structured(Config)
        OmegaConf.set_struct(schema, False)  # keys appended with + survive, as in kvlab.analysis.sweeps.predict_dir
        sys.path[:0] = [str(importable)] if importable else []
        try:
            setup = build(OmegaConf.merge(schema, OmegaConf.load(run_dir / "config.yaml")))
            segments, pulls = plan_run(setup).segments, setup.transport.cls().pulls
        finally:
            if importable:
                sys.path.remove(str(importable))
    broken = metrics.violations(records.read_rows(run_dir), records.read_summary(run_dir), parts, segments,
                                pulls=pulls)
    assert not broken, broken
