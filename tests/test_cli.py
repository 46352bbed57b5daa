"""The ``kvlab`` command line as a newcomer and a Hydra user meet it: help that lists the commands,
Hydra's flags meaning what they mean in any Hydra app, and nothing left behind by a command that only looks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _left(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_commands(kvlab_cli, tmp_path, flag):
    out = kvlab_cli(flag, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for command in ("plan", "run"):
        assert sum(ln.split()[:1] == [command] for ln in lines) == 1, out.stdout
    assert _left(tmp_path) == []


def test_no_command_or_an_unknown_one_says_which_exist(kvlab_cli, tmp_path):
    bare = kvlab_cli(cwd=tmp_path)
    assert bare.returncode == 2 and "plan" in bare.stderr and "run" in bare.stderr
    wrong = kvlab_cli("runn", "ctx.tp=1", cwd=tmp_path)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().count("\n") == 0, wrong.stderr
    assert "runn" in wrong.stderr and "plan, run" in wrong.stderr


@pytest.mark.parametrize("command", ["run", "plan"])
def test_command_help_lists_groups_not_schemas(kvlab_cli, tmp_path, command):
    out = kvlab_cli(command, "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    groups = {}
    for ln in out.stdout.split("== Config ==")[0].splitlines():  # the config below has the same keys
        if ln.split(":")[0] in ("model", "transfer", "workload", "prefill", "logger"):
            groups[ln.split(":")[0]] = ln.split(":", 1)[1]
    assert len(groups) == 5, out.stdout
    assert "llama3_8b" in groups["model"] and "layerwise" in groups["transfer"]
    assert "base_" not in out.stdout
    assert "name: tiny_gqa" in out.stdout  # the config follows, as in Hydra's help
    assert _left(tmp_path) == []


def test_help_shows_the_config_the_overrides_make(kvlab_cli, tmp_path):
    out = kvlab_cli("run", "model=llama3_8b", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "name: llama3_8b" in out.stdout
    assert _left(tmp_path) == []


@pytest.mark.parametrize("args", [["--info"], ["--info", "searchpath"], ["--cfg", "job"],
                                  ["ctx.tp=1", "gen.tp=1", "--cfg", "job"], ["--cfg", "hydra"], ["--hydra-help"]])
def test_looking_leaves_nothing_behind(kvlab_cli, tmp_path, args):
    out = kvlab_cli("run", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert _left(tmp_path) == []


def test_cfg_job_shows_the_overridden_config(kvlab_cli, tmp_path):
    out = kvlab_cli("plan", "--cfg", "job", "model=tiny_mla", "gen.tp=2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "name: tiny_mla" in out.stdout and "hydra:" not in out.stdout
    assert _left(tmp_path) == []


def test_shell_completion_installs_for_kvlab(kvlab_cli, tmp_path):
    out = kvlab_cli("run", "-sc", "install=bash", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("hydra_bash_completion kvlab")
    assert kvlab_cli("-sc", "install=bash", cwd=tmp_path).stdout == out.stdout
    assert _left(tmp_path) == []


@pytest.mark.parametrize("line, want, unwanted", [
    ("kvlab r", {"run"}, {"plan"}),
    ("kvlab run model=", {"model=llama3_8b", "model=tiny_gqa"}, {"model=base_model"}),
    ("kvlab plan transfer=", {"transfer=layerwise"}, {"transfer=base_transfer"}),
])
def test_shell_completion_knows_the_commands(kvlab_cli, tmp_path, line, want, unwanted):
    out = kvlab_cli("-sc", "query=bash", cwd=tmp_path, env={"COMP_LINE": line, "COMP_POINT": str(len(line))})
    assert out.returncode == 0, out.stderr
    words = set(out.stdout.split())
    assert want <= words and not unwanted & words, out.stdout
    assert _left(tmp_path) == []


def test_a_bad_flag_is_one_line(kvlab_cli, tmp_path):
    out = kvlab_cli("run", "--cfg", "jobs", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "--cfg" in out.stderr and "'jobs'" in out.stderr and "'job'" in out.stderr
    assert _left(tmp_path) == []


def test_a_bad_override_while_looking_is_one_line(kvlab_cli, tmp_path):
    out = kvlab_cli("run", "--cfg", "job", "ctx.tp=four", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "ctx.tp=four" in out.stderr and "integer" in out.stderr
    assert _left(tmp_path) == []


def test_plan_in_a_pipe_is_not_cut_to_80_columns(kvlab_cli, tmp_path):
    out = kvlab_cli("plan", "model=llama3_8b", "ctx.tp=4", "gen.tp=2", f"hydra.run.dir={tmp_path / 'plan'}",
                    cwd=tmp_path, env={"COLUMNS": ""})
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout, out.stdout  # rich's mark of a cut cell
    assert "largest chunk MiB" in out.stdout
    assert any(ln.startswith("predicted") and "per rank" in ln for ln in out.stdout.splitlines()), out.stdout
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["total_bytes"] > 0


def test_plan_with_a_flag_after_the_overrides_writes_where_it_says(kvlab_cli, tmp_path):
    out = kvlab_cli("plan", "ctx.tp=1", "-cn", "config", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    written = list((tmp_path / "outputs").glob("*/plan.json"))
    assert len(written) == 1 and str(written[0]) in out.stdout.replace("\n", "")


@pytest.mark.slow
def test_run_with_flags_and_the_default_directory(kvlab_cli, tmp_path):
    out = kvlab_cli("run", "logger=quiet", "workload.requests=1", "workload.isl=256", "-cn", "config", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    runs = list((tmp_path / "outputs").iterdir())
    assert len(runs) == 1 and (runs[0] / "summary.json").exists(), _left(tmp_path)


def test_overrides_on_both_sides_of_a_flag(kvlab_cli, tmp_path):
    out = kvlab_cli("plan", "logger=quiet", "-m", "ctx.tp=1,2", "gen.tp=1", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                    cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plans = sorted((tmp_path / "sweep").glob("*/plan.json"))
    assert [json.loads(p.read_text())["ctx"]["tp"] for p in plans] == [1, 2]


def test_python_warnings_print_in_one_line_without_their_source():
    code = ("import warnings; from kvlab import cli; cli.main(['--help']); "
            "warnings.warn('the cost model has no prediction here', UserWarning)")
    p = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "kvlab: warning: the cost model has no prediction here (UserWarning)\n", p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("quote", ["", "'"], ids=["bare", "quoted"])
def test_a_run_directory_with_spaces_works_quoted_or_not(tmp_path, kvlab_cli, quote):
    run_dir = tmp_path / "my runs" / "a b"
    p = kvlab_cli("run", f"hydra.run.dir={quote}{run_dir}{quote}", "logger=quiet", "workload.requests=1",
                  cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stderr
    assert json.loads((run_dir / "summary.json").read_text())["verified"]
    assert [d.name for d in tmp_path.iterdir()] == ["my runs"]  # none named with the quotes, here or there
    assert [d.name for d in run_dir.parent.iterdir()] == ["a b"]
