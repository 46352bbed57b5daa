"""The command blocks of README.md and docs/: what tests/test_docs_commands.py runs, and the quoted outputs this
script regenerates, so that no figure in them is typed.

A fenced block's commands are its lines that start with ``$ `` where it has any (the rest is their output),
else its lines that start with ``kvlab `` or ``python scripts/`` (``torchrun ... -m kvlab ARGS``: as ``kvlab ARGS``);
a line ending in ``\\`` goes on. An HTML comment
on the lines right above a block says how to treat it:

- ``<!-- docs-test: cfg-job REASON -->``: the test appends ``--cfg job`` (the config is composed and checked,
  nothing runs), for a command that runs too long for the suite;
- ``<!-- docs-test: help REASON -->`` (scripts): the test runs ``--help`` and checks every ``--flag`` quoted exists;
- ``<!-- docs-test: error -->``: the command shows bad input: it must stop with exit code 2 and one ``kvlab:`` line,
  the one the block quotes;
- ``<!-- docs-test: skip REASON -->``: not run, for the reason given (a GPU, a file the reader has);
- ``<!-- docs-sample -->``, or ``<!-- docs-sample: grep REGEX -->``: this script runs each ``$`` command of the
  block and writes what it printed below it (with ``grep``: ``...`` and the lines matching REGEX).

    python scripts/docs_samples.py              # regenerate every sample in README.md and docs/
    python scripts/docs_samples.py --check      # list them and their commands, run nothing

``--in-process`` (what the test uses) reads JSON lines ``{"command": ..., "mode": "cfg-job" | "error"}`` and runs each
``kvlab`` command through ``kvlab.cli.main`` in this one process (``--cfg job`` appended), printing one JSON line
per command: its exit code and what it printed. A sweep (``-m``) is checked as its first job, since Hydra prints
no config for a sweep: ``-m`` dropped, each swept value its first.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!--\s*docs-(test|sample)(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)")
COMMAND = re.compile(r"^(kvlab |python scripts/)")
# torchrun starting kvlab: checked as the kvlab command it starts (its ranks need the launcher, not the suite)
TORCHRUN = re.compile(r"^torchrun\s.*?-m kvlab (.*)$")
WIDTH = "110"  # the terminal width samples are printed at (rich reads COLUMNS)


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lines: list[str]  # the block's content
    test: tuple[str, str] = ("run", "")  # (mode, reason): run, cfg-job, help or skip
    sample: str | None = None  # None: not a sample; "": the whole output; else "grep REGEX"
    prompts: bool = False  # its commands are its `$ ` lines
    commands: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _commands(lines: list[str]) -> tuple[bool, list[str]]:
    prompts = any(ln.startswith("$ ") for ln in lines)
    out, cur = [], None
    for ln in lines:
        if cur is not None:  # a continued line
            cur += " " + ln.strip()
        elif prompts and ln.startswith("$ "):
            cur = ln[2:].strip()
        elif not prompts and (COMMAND.match(ln) or ln.startswith("torchrun ")):
            cur = ln.strip()
        else:
            continue
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        if m := TORCHRUN.match(cur):
            cur = f"kvlab {m.group(1)}"
        out.append(cur)
        cur = None
    return prompts, [c for c in out if COMMAND.match(c)]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with its markers and commands."""
    text = path.read_text().splitlines()
    out, i = [], 0
    while i < len(text):
        m = FENCE.match(text[i])
        if not m:
            i += 1
            continue
        indent, fence = m.groups()
        j = i + 1
        while j < len(text) and not text[j].strip().startswith(fence[:3]):
            j += 1
        content = [ln[len(indent):] if ln.startswith(indent) else ln for ln in text[i + 1:j]]
        b = Block(path, i + 1, content)
        k = i - 1
        while k >= 0 and (mk := MARK.match(text[k].strip())):
            kind, arg = mk.group(1), (mk.group(2) or "").strip()
            if kind == "sample":
                b.sample = arg
            else:
                mode, _, reason = arg.partition(" ")
                b.test = (mode, reason.strip())
            k -= 1
        b.prompts, b.commands = _commands(content)
        out.append(b)
        i = j + 1
    return out


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def every_block() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


def environment(bin_dir: Path) -> dict[str, str]:
    """The environment commands run in: ``kvlab`` and ``python`` of this interpreter, this checkout first."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, exe in (("kvlab", f'exec "{sys.executable}" -m kvlab "$@"'), ("python", f'exec "{sys.executable}" "$@"')):
        f = bin_dir / name
        f.write_text(f"#!/bin/sh\n{exe}\n")
        f.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["COLUMNS"] = WIDTH
    # kvlab sim calibrate writes a profile to the user's config directory: the sandbox's, not the reader's
    env["XDG_CONFIG_HOME"] = str(bin_dir.parent / "config")
    return env


def workdir(tmp: Path) -> Path:
    """A directory that looks like a checkout to the commands (scripts, traces, results), in which what they
    write (outputs/, multirun/, results/...) stays away from the repository."""
    work = tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    for name in ("scripts", "traces", "notebooks", "conf", "kernels"):
        if not (work / name).exists():
            (work / name).symlink_to(ROOT / name)
    if not (work / "results").exists():
        subprocess.run(["cp", "-r", str(ROOT / "results"), str(work / "results")], check=True)
    return work


def run_shell(command: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def render(b: Block, cwd: Path, env: dict) -> list[str]:
    out = []
    for cmd in b.commands:
        p = run_shell(cmd, cwd, env, timeout=600)
        printed = (p.stdout + p.stderr).replace(f"{cwd}/", "").rstrip("\n").splitlines()
        printed = [ln.rstrip() for ln in printed]
        if b.sample.startswith("grep "):
            rx = re.compile(b.sample[5:].strip())
            printed = ["...", *[ln for ln in printed if rx.search(ln)]]
        out += [f"$ {cmd}", *printed]
    return out


def regenerate(only: str | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="kvlab-samples-") as tmp:
        env = environment(Path(tmp) / "bin")
        cwd = workdir(Path(tmp))
        for path in pages():
            lines = path.read_text().splitlines()
            changed = False
            for b in reversed(blocks(path)):  # from the end: earlier line numbers stay valid
                if b.sample is None or not b.prompts or (only and only not in b.where):
                    continue
                print(f"{b.where}: {' ; '.join(b.commands)}", flush=True)
                new = render(b, cwd, env)
                lines[b.line:b.line + len(b.lines)] = new
                changed = True
            if changed:
                path.write_text("\n".join(lines) + "\n")


def first_job(argv: list[str]) -> list[str]:
    """A sweep's overrides as its first job: ``-m`` dropped, ``key=a,b,c`` as ``key=a`` (commas inside brackets or
    quotes belong to one value)."""
    out = []
    for a in argv:
        if a in ("-m", "--multirun"):
            continue
        key, eq, value = a.partition("=")
        if eq and not a.startswith("hydra.") and "," in value and value[:1] not in "[{'\"":
            value = value.split(",")[0]
        out.append(f"{key}{eq}{value}")
    return out


def in_process() -> None:
    import contextlib
    import io
    import json

    from hydra.core.global_hydra import GlobalHydra

    from kvlab.cli import main as kvlab_main

    for line in sys.stdin:
        job = json.loads(line)
        argv = shlex.split(os.path.expandvars(job["command"]), comments=True)
        assert argv[0] == "kvlab", argv
        argv = [*first_job(argv[1:]), "--cfg", "job"]
        out, err, code = io.StringIO(), io.StringIO(), 0
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                kvlab_main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:  # noqa: BLE001 -- reported as the command's failure, with what it raised
            code, err = 1, io.StringIO(f"{err.getvalue()}{type(e).__name__}: {e}")
        GlobalHydra.instance().clear()
        print(json.dumps({**job, "argv": argv, "code": code, "stdout": out.getvalue()[-4000:],
                          "stderr": err.getvalue()[-4000:]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="list the samples and their commands; run nothing")
    ap.add_argument("--only", help="regenerate only the samples whose FILE:LINE contains this")
    ap.add_argument("--in-process", action="store_true", help="check kvlab commands read from stdin (JSON lines)")
    args = ap.parse_args()
    if args.in_process:
        return in_process()
    if args.check:
        for b in every_block():
            if b.sample is not None:
                print(f"{b.where}: {' ; '.join(shlex.quote(c) for c in b.commands)}")
        return
    regenerate(args.only)


if __name__ == "__main__":
    main()
