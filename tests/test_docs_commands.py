"""Docs that cannot lie: every ``kvlab ...`` and ``python scripts/...`` command quoted in a fenced block of README.md
or docs/ runs here, on the CPU, with the extras installed, as scripts/docs_samples.py collects them (its docstring
has the markers): as written by default; with ``--cfg job`` (config composed and checked, all in one process)
where the page marks it too long to run; a script's ``--help`` checked for the quoted flags; skipped only with
a reason on the page. Each command's failure names it and where it is quoted."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import script_module

ROOT = Path(__file__).resolve().parents[1]
docs = script_module("docs_samples")

MODES = {"run", "cfg-job", "help", "skip", "error"}
BLOCKS = [b for b in docs.every_block() if b.commands]


def _by_mode(*modes: str) -> list[tuple[str, str, str]]:
    """(command, where, the block's text) for each distinct command whose block has one of ``modes``."""
    seen: dict[str, tuple[str, str, str]] = {}
    for b in BLOCKS:
        if b.test[0] in modes:
            for c in b.commands:  # one run of a command quoted twice, with its comment or without
                seen.setdefault(shlex.join(shlex.split(c, comments=True)), (c, b.where, "\n".join(b.lines)))
    return list(seen.values())


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs-commands")
    return docs.workdir(tmp), docs.environment(tmp / "bin")


def test_every_quoted_command_is_collected_and_marked_with_a_reason():
    commands = [c for b in BLOCKS for c in b.commands]
    assert len(commands) >= 20, commands  # README's five and the guide's: a parser that finds none fails here
    for b in BLOCKS:
        mode, reason = b.test
        assert mode in MODES, f"{b.where}: docs-test mode {mode!r}; use one of {sorted(MODES)}"
        if mode in ("skip", "cfg-job", "help"):
            assert reason, f"{b.where}: docs-test: {mode} needs its reason on the same line"
        if mode in ("cfg-job", "error"):
            assert all(c.startswith("kvlab ") for c in b.commands), f"{b.where}: {mode} is for kvlab commands"
    readme = [c for b in BLOCKS if b.path.name == "README.md" for c in b.commands]
    assert readme[:5] == ["kvlab plan model=llama3_8b ctx.tp=2 gen.tp=1 workload.isl=16384 cost=h200", "kvlab run",
                          "kvlab run ctx.tp=4", "kvlab link", "kvlab sim"], readme


def test_the_parser_reads_prompts_continuations_and_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n<!-- docs-test: cfg-job too long -->\n<!-- docs-sample: grep ^x -->\n```\n"
                    "$ kvlab run a=1 \\\n    b=2\nkvlab: output, not a command\n```\n\n```\nkvlab plan\n"
                    "python scripts/x.py --out f   # a comment\npip install kvlab\n"
                    "torchrun --nnodes=2 \\\n  -m kvlab run b=2\n```\n")
    first, second = docs.blocks(page)
    assert first.test == ("cfg-job", "too long") and first.sample == "grep ^x" and first.prompts
    assert first.commands == ["kvlab run a=1 b=2"]
    assert second.test == ("run", "") and second.sample is None
    assert second.commands == ["kvlab plan", "python scripts/x.py --out f   # a comment", "kvlab run b=2"]
    assert docs.first_job(["-m", "a=1,2", "b=[1,2]", "hydra.sweep.dir=x", "'c=3'"]) == ["a=1", "b=[1,2]",
                                                                                     "hydra.sweep.dir=x", "'c=3'"]


def test_commands_too_long_to_run_compose_a_valid_config_and_bad_input_stops_in_one_line(sandbox):
    """All in one process (a second each, where a process of its own would take five): ``--cfg job`` composes the
    config and runs kvlab's checks of it; a quoted error must be the one kvlab prints."""
    cwd, env = sandbox
    errors = {c for c, _, _ in _by_mode("error")}
    jobs = [{"command": c, "where": w, "mode": "error" if c in errors else "cfg-job", "quoted": text}
            for c, w, text in _by_mode("cfg-job", "error", "run")
            if c.startswith("kvlab ") and not c.startswith("kvlab sim calibrate")]  # no Hydra config to compose
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_samples.py"), "--in-process"], cwd=cwd, env=env,
                       input="".join(json.dumps(j) + "\n" for j in jobs), capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(jobs), p.stderr[-3000:]
    failed = []
    for r in results:
        if r["mode"] == "error":
            said = [ln for ln in r["stderr"].splitlines() if ln.startswith("kvlab:")]
            if r["code"] != 2 or len(said) != 1 or said[0] not in r["quoted"]:
                failed.append(f"{r['where']}: `{r['command']}` should stop with the quoted kvlab: line; exit "
                              f"{r['code']}, printed:\n{r['stderr'][-1500:]}")
        elif r["code"] != 0:
            failed.append(f"{r['where']}: `{r['command']}` (checked as `kvlab {' '.join(r['argv'])}`) exit "
                          f"{r['code']}:\n{r['stderr'][-1500:]}")
    assert not failed, "\n\n".join(failed)


def _run_ids(items):
    return [f"{w}:{c[:60]}" for c, w, _ in items]


RUN = _by_mode("run")


@pytest.mark.slow
@pytest.mark.parametrize("command,where,text", RUN, ids=_run_ids(RUN))
def test_quoted_command_runs(sandbox, command, where, text):
    cwd, env = sandbox
    p = docs.run_shell(command, cwd, env, timeout=280)
    assert p.returncode == 0, f"{where}: `{command}` exit {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}"


HELP = _by_mode("help")
_HELPS: dict[str, subprocess.CompletedProcess] = {}


@pytest.mark.slow
@pytest.mark.parametrize("command,where,text", HELP, ids=_run_ids(HELP))
def test_quoted_script_takes_the_quoted_flags(sandbox, command, where, text):
    cwd, env = sandbox
    argv = shlex.split(command, comments=True)
    if argv[1] not in _HELPS:  # once per script: most import torch before they parse
        _HELPS[argv[1]] = docs.run_shell(f"{shlex.join(argv[:2])} --help", cwd, env, timeout=120)
    p = _HELPS[argv[1]]
    assert p.returncode == 0, f"{where}: `{shlex.join(argv[:2])} --help` exit {p.returncode}:\n{p.stderr[-2000:]}"
    flags = {a.split("=")[0] for a in argv[2:] if re.fullmatch(r"--[\w-]+", a.split("=")[0])}
    missing = sorted(f for f in flags if not re.search(rf"{re.escape(f)}\b", p.stdout))
    assert not missing, f"{where}: `{command}`: {missing} not among {argv[1]}'s options:\n{p.stdout[-2000:]}"
    usage = p.stdout.split("\n\n")[0]
    while re.search(r"\[[^\[\]]*\]", usage):  # what stays outside [...] is required
        usage = re.sub(r"\[[^\[\]]*\]", "", usage)
    required = set(re.findall(r"--[\w-]+", usage))
    assert required <= flags, f"{where}: `{command}` lacks {sorted(required - flags)}, which {argv[1]} requires"
