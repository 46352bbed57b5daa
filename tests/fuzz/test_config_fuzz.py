"""The config fuzzer: every field of every group, read from the schema (tests/fuzz/edges.py), drawn from its
type's edges, for ``kvlab run``, ``plan``, ``link``, ``sim``, ``sim calibrate`` and the Python API.

Each draw ends as one ``kvlab:`` line naming the field, exit 2, before any rank starts and with no run
directory left, or as a correct run; never a traceback, never a silent minute (each draw has a timeout).
Validation draws call the checks the command line makes before Hydra starts, in this process, many per
test; a sample of draws runs the real command line. A failing draw prints the command that reproduces it.

The default suite draws a few dozen; ``pytest -m fuzz`` (or ``--hypothesis-profile=fuzz``) draws the longer
budget, real runs of the draws that pass validation included.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from fuzz import edges
from kvlab.core.errors import ConfigError

DRAW_S = 60  # no draw may be silent this long: validation, or a whole run of the small config below
# no shrinking: a failing draw is printed as drawn, with its command (shrinking would validate it again many times)
QUICK = dict(deadline=None, suppress_health_check=list(HealthCheck),
             phases=[Phase.explicit, Phase.reuse, Phase.generate])
FUZZ = int(os.environ.get("KVLAB_FUZZ_EXAMPLES", "400"))
# a run's config kept small, so that a draw that passes validation is a real run of seconds: drawn values
# are put after these, so they win
SMALL = ["model=tiny_gqa", "workload.requests=2", "workload.isl=256", "logger=quiet", "transfer.baseline=false"]


class Silent(Exception):
    pass


@contextlib.contextmanager
def bounded_time(what: str, seconds: float = DRAW_S):
    def alarm(signum, frame):
        raise Silent(f"{what}: nothing ended within {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _hydra_errors() -> tuple[type, ...]:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return HydraException, OmegaConfBaseException


def validate(command: str, overrides: list[str]) -> str | None:
    """What the command line says before Hydra starts: None (valid) or its one line. Raises what it should not."""
    from kvlab.cli.commands import hydra_message

    try:
        if command == "sim":
            from kvlab.sim.run import build_sim, compose_sim

            build_sim(compose_sim(overrides))
            return None
        from kvlab.cli.commands import validate_overrides

        validate_overrides(overrides, memory=command in ("run", "link"), command=command)
    except ConfigError as e:
        return str(e)
    except _hydra_errors() as e:  # the override grammar or the schema's types: Hydra's words, on one line
        return hydra_message(e, overrides)
    return None


def assert_names(line: str | None, key: str, cmd: str) -> None:
    """One line that names the drawn field, or another field of the config that the drawn value contradicts
    (``model.attention=mla`` on a GQA model is refused naming the MLA dims it lacks): never words without a key."""
    if line is None:
        return
    assert "\n" not in line, f"more than one line: {line!r}\nreproduce: {cmd}"
    named = re.match(r"([\w.\[\]]+)=", line)
    assert key in line or named and named.group(1).split("[")[0] in KEYS, \
        f"the line does not name {key} nor any field: {line!r}\nreproduce: {cmd}"


def draws(fields):
    return st.sampled_from(fields).flatmap(lambda f: st.tuples(st.just(f[0]), edges.value_edges(f[2])))


RUN_FIELDS, SIM_FIELDS = edges.run_fields(), edges.sim_fields()
# what a line may name: a field, or a group chosen by name (model=..., transport=..., check=...)
KEYS = {k for k, _, _ in SIM_FIELDS} | {k.split('.')[0] for k, _, _ in SIM_FIELDS} | {"prefill"}


@settings(max_examples=40, **QUICK)
@given(command=st.sampled_from(["run", "plan", "link"]), draw=draws(RUN_FIELDS), second=st.none() | draws(RUN_FIELDS))
def test_run_plan_link_fields(command, draw, second):
    """One drawn field (and sometimes a second): valid, or one line naming a drawn one."""
    ovs = [edges.override(*draw)] + ([edges.override(*second)] if second else [])
    cmd = edges.command_line(command, ovs)
    note(f"reproduce: {cmd}")
    with bounded_time(cmd):
        line = validate(command, ovs)
    if second and line is not None and second[0] in line and draw[0] not in line:
        draw = second
    assert_names(line, draw[0], cmd)


@settings(max_examples=15, **QUICK)
@given(draw=draws(SIM_FIELDS))
def test_sim_fields(draw):
    ovs = [edges.override(*draw)]
    cmd = edges.command_line("sim", ovs)
    note(f"reproduce: {cmd}")
    with bounded_time(cmd):
        line = validate("sim", ovs)
    if line is None:  # valid: the simulation itself must end, and end well, within the draw's time
        from kvlab.sim.run import build_sim, compose_sim, run

        with bounded_time(cmd):
            try:
                run(build_sim(compose_sim(ovs + ["workload.requests=16"])))
            except ConfigError as e:  # what only the run finds (a GPU too small for a request): one line, named
                assert_names(str(e), draw[0], cmd)
        return
    assert_names(line, draw[0], cmd)


def path_edges(tmp: Path) -> list[str]:
    """Places that cannot be written, or can only be written with care."""
    a_file = tmp / "a_file"
    a_file.write_text("x")
    ro = tmp / "read_only"
    ro.mkdir(exist_ok=True)
    ro.chmod(0o555)
    return [str(a_file), str(a_file / "below"), str(ro / "run"), str(tmp / ("n" * 300)),
            str(tmp / "/".join(["d" * 200] * 25)), str(tmp / "with spaces" / "ünï"), ""]


@settings(max_examples=8, **QUICK)
@given(draw=draws(RUN_FIELDS), where=st.integers(0, 6))
def test_python_api(tmp_path_factory, draw, where):
    """kvlab.api.run_transfer: a ConfigError naming the field or the run directory, or a run (the fuzz budget)."""
    from kvlab import api

    tmp = tmp_path_factory.mktemp("api")
    run_dir = path_edges(tmp)[where]
    ovs = SMALL + [edges.override(*draw)]
    note(f"reproduce: kvlab.api.run_transfer({ovs!r}, {run_dir!r})")
    line = validate("run", ovs)
    if line is None and not _fuzzing():
        return  # a real run: the fuzz budget's
    try:
        with bounded_time("api"):
            api.run_transfer(ovs, run_dir)
    except ConfigError as e:
        # the same rule as the command line's: the drawn field, or a field the drawn value contradicts
        # (model.attention=mla on a GQA model names the MLA dims it lacks), or the run directory
        if not str(e).startswith("run_dir="):
            assert_names(str(e), draw[0], f"kvlab.api.run_transfer({ovs!r}, {run_dir!r})")
        assert "\n" not in str(e)
        assert line is not None or str(e).startswith("run_dir=")
    finally:
        (tmp / "read_only").chmod(0o755)


def _fuzzing() -> bool:
    return os.environ.get("KVLAB_FUZZ") == "1"


def cli(command: str, overrides: list[str], cwd: Path, timeout: float = DRAW_S) -> tuple[subprocess.CompletedProcess,
                                                                                         float]:
    from conftest import kvlab_argv

    start = time.monotonic()
    out = subprocess.run(kvlab_argv(*command.split(), *overrides), cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    return out, time.monotonic() - start


def check_cli(command: str, draw, tmp: Path) -> None:
    run_dir = tmp / "run"
    # sim: its own cluster's layouts; link: a short curve, so that a valid draw is a run of seconds
    base = {"plan": [], "sim": ["workload.requests=16"], "link": [*SMALL, "link.max_bytes=1048576"]}.get(command, SMALL)
    ovs = base + [edges.override(*draw), f"hydra.run.dir={run_dir}"]
    cmd = edges.command_line(command, ovs)
    note(f"reproduce (in {tmp}): {cmd}")
    line = validate(command, ovs[:-1])
    if line is None and command in ("run", "link") and not _fuzzing():
        return  # a real run: the fuzz budget's
    if any("\x00" in o for o in ovs):
        return  # no command line can carry a NUL byte (the OS refuses the argument): validated above, in-process
    try:
        out, _ = cli(command, ovs, tmp, timeout=DRAW_S if line is not None or command == "plan" else 180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"silent for the whole draw\nreproduce: {cmd}")
    assert "Traceback" not in out.stderr + out.stdout, f"{out.stderr[-3000:]}\nreproduce: {cmd}"
    if line is not None:
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvlab: "), \
            f"rc={out.returncode} {out.stderr[-2000:]}\nreproduce: {cmd}"
        assert_names(lines[0].removeprefix("kvlab: error: "), draw[0], cmd)
        assert not run_dir.exists(), f"a run directory was left\nreproduce: {cmd}"
    else:
        assert out.returncode == 0, f"rc={out.returncode} {out.stderr[-2000:]}\nreproduce: {cmd}"


@pytest.mark.slow
@settings(max_examples=4, **QUICK)
@given(command=st.sampled_from(["run", "plan", "link", "sim"]), data=st.data())
def test_cli_sample(tmp_path_factory, command, data):
    """The real command line on a sample of the draws."""
    draw = data.draw(draws(SIM_FIELDS if command == "sim" else RUN_FIELDS))
    check_cli(command, draw, tmp_path_factory.mktemp("cli"))


@settings(max_examples=6, **QUICK)
@given(where=st.integers(0, 6), name=st.sampled_from(["", "x" * 300, "ünï", "with space", "../up"]))
def test_sim_calibrate_paths(tmp_path_factory, where, name):
    """kvlab sim calibrate on run directories and outputs that are no such thing: one line, exit 2."""
    tmp = tmp_path_factory.mktemp("cal")
    place = path_edges(tmp)[where]
    argv = ["sim", "calibrate", place or "''", "--name", name or "fitted", "--out", str(tmp / "out.yaml")]
    cmd = edges.command_line(" ".join(argv[:2]), argv[2:])
    note(f"reproduce: {cmd}")
    from kvlab.sim.cmd import calibrate_main

    err = []
    try:
        with bounded_time(cmd), contextlib.redirect_stderr(_Collect(err)):
            calibrate_main(argv[2:])
    except SystemExit as e:
        assert e.code == 2, (e.code, err, cmd)
        text = "".join(err).strip()
        assert len(text.splitlines()) == 1 and text.startswith("kvlab: "), (text, cmd)
    finally:
        (tmp / "read_only").chmod(0o755)


class _Collect:
    def __init__(self, out: list):
        self.out = out

    def write(self, s):
        self.out.append(s)

    def flush(self):
        pass


@pytest.mark.fuzz
@pytest.mark.slow
@pytest.mark.timeout(0)  # the budget is its draws' count, each bounded by its own time
@settings(max_examples=FUZZ, **QUICK)
@given(command=st.sampled_from(["run", "plan", "link", "sim"]), data=st.data())
def test_fuzz_budget(tmp_path_factory, command, data, monkeypatch):
    """The longer budget: the real command line on every draw, runs included."""
    monkeypatch.setenv("KVLAB_FUZZ", "1")
    draw = data.draw(draws(SIM_FIELDS if command == "sim" else RUN_FIELDS))
    check_cli(command, draw, tmp_path_factory.mktemp("fuzz"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
