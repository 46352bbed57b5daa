"""``kvlab <command> [hydra overrides]``: plan | run.

Overrides are checked before Hydra starts, so a bad one ends in one line naming the field,
the value and what would work (exit code 2), before any rank starts or any memory is taken.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from kvlab.errors import ConfigError

COMMANDS = ("plan", "run")
GROUPS = ("model", "transfer", "transport", "workload", "prefill", "logger", "parallel", "experiment", "cost")
USAGE = "usage: kvlab {plan,run} [-m] [key=value ...]   e.g. kvlab plan model=llama3_8b ctx.tp=4 gen.tp=2"


def _hydra_message(exc: BaseException, overrides: list[str] = ()) -> str:
    text = str(exc) + ("\n" + str(exc.__cause__) if exc.__cause__ else "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    flat = "; ".join(dict.fromkeys(lines))
    return _plain_message(flat, overrides) or flat


def _keys_of(path: list[str]) -> list[str] | None:
    """Keys of the structured config node at ``path`` (None when it is not a known dataclass)."""
    import dataclasses
    import typing

    from kvlab.config import Config

    node = Config
    for part in path:
        hints = typing.get_type_hints(node)
        node = hints.get(part)
        if node is None or not dataclasses.is_dataclass(node):
            return None
    return [f.name for f in dataclasses.fields(node)]


def _plain_message(flat: str, overrides: list[str]) -> str | None:
    """OmegaConf's validation errors rewritten as ``key=value: what would work``."""
    m = re.search(r"full_key: ([\w.\[\]]+)", flat)
    if not m:
        return None
    key = m.group(1)
    base = key.split("[")[0]
    value = "?"
    for ov in overrides:
        k, _, v = ov.partition("=")
        k = re.sub(r"^[+~]+", "", k)
        if k == base or k.startswith(base + "."):  # a key under an unknown one is reported in full
            base, value = k, v
            break
    if m := re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", flat):
        return f"{base}={value}: use one of {m.group(2)}"
    if "is not a valid bool" in flat:
        return f"{base}={value}: must be true or false"
    if m := re.search(r"could not be converted to (\w+)", flat):
        kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(m.group(1), m.group(1))
        where = f" (element {key[len(base):]})" if key != base else ""
        return f"{base}={value}: must be {kind}{where}"
    if m := re.search(r"Key '(\w+)' not in '(\w+)'", flat):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        keys = _keys_of(parent.split(".") if parent else [])
        options = f"; {parent or 'the config'} has {', '.join(keys)}" if keys else ""
        return f"{base}={value}: no such key{options}"
    return None


def check_overrides(overrides: list[str], search: list[str] = (), memory: bool = False) -> str | None:
    """None if the overrides compose into a valid setup (that fits this host's memory, with ``memory``:
    kvlab.budget), else one line saying what is wrong. ``search``: ``hydra.searchpath=[file://DIR,...]``
    overrides, whose DIRs hold a user's own group files."""
    from kvlab import budget
    from kvlab.checks import check_overrides_shape
    from kvlab.config import CONF_DIR, build, compose

    dirs = [CONF_DIR] + [Path(d) for s in search for d in re.findall(r"file://([^,\]\s'\"]+)", s)]
    for ov in overrides:
        m = re.fullmatch(r"\+?(\w+)=(.*)", ov)
        if m and m.group(1) in GROUPS:
            group, value = m.groups()
            options = sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})
            if value not in options:
                return f"{group}={value}: unknown {group}; choose one of {', '.join(options)}"
    try:
        check_overrides_shape(overrides)
        cfg = compose([*search, *overrides])
        setup = build(cfg)
        if memory:  # before the plan: a huge workload.requests is refused, not built
            budget.check_host(setup)
        if setup.needs_preflight:  # fault positions and capacities that only the plan can check
            from kvlab.preflight import preflight

            preflight(setup)
    except ConfigError as e:
        return str(e)
    except Exception as e:  # Hydra's own composition errors: keep their words, on one line
        return _hydra_message(e, overrides)
    return None


def sweep_points(overrides: list[str], search: list[str] = ()) -> list[list[str]]:
    """The overrides of every job ``-m`` would run: the sweep in the config (``hydra.sweeper.params``,
    set by an experiment) and on the command line, expanded the way Hydra's basic sweeper does."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvlab.config import compose

    parser = OverridesParser.create()
    fixed = [o.input_line for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]
    head = compose([*search, *fixed], return_hydra_config=True)
    params = head.hydra.sweeper.get("params") or {}
    parsed = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _check_sweep(overrides: list[str], search: list[str], memory: bool) -> str | None:
    try:
        jobs = sweep_points(overrides, search)
    except ConfigError as e:
        return str(e)
    except Exception as e:  # a sweep Hydra cannot parse: its words, on one line
        return _hydra_message(e, overrides)
    for job in jobs:
        problem = check_overrides(job, search, memory)
        if problem:
            return problem + (f" (in the sweep job {' '.join(job)})" if len(jobs) > 1 else "")
    return None


def _run_dir(rest: list[str]) -> Path:
    """The run directory Hydra will use: ``hydra.run.dir`` as given, or the default of conf/config.yaml."""
    for a in rest:
        if a.startswith("hydra.run.dir="):
            return Path(a.partition("=")[2])
    from kvlab.config import compose

    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    return Path(compose(overrides, return_hydra_config=True).hydra.run.dir)


def _fail(problem: str, code: int = 2):
    print(f"kvlab: error: {problem}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    from kvlab import interrupt, rundir

    command, rest = argv[0], argv[1:]
    held = None
    with interrupt.as_exit("before any rank started"):  # Ctrl-C or SIGTERM while starting: one line
        multirun = any(a in ("-m", "--multirun") for a in rest)
        overrides = [a for a in rest if (a.startswith("~") or not a.startswith("-") and "=" in a)
                     and not a.startswith("hydra.")]
        search = [a for a in rest if a.startswith("hydra.searchpath=")]
        problem = (_check_sweep(overrides, search, command == "run") if multirun
                   else check_overrides(overrides, search, command == "run"))
        if problem:
            _fail(problem)
        try:
            if not multirun and (command == "plan" or int(os.environ.get("RANK", 0)) == 0):
                # one run per directory, locked before Hydra writes anything there; pinned, so that the
                # directory Hydra creates is the one locked (the default names it after the clock)
                held = _run_dir(rest)
                if not any(a.startswith("hydra.run.dir=") for a in rest):
                    rest = rest + [f"hydra.run.dir={held}"]
                rundir.acquire(held)
            elif multirun:
                sweep = next((a.partition("=")[2] for a in rest if a.startswith("hydra.sweep.dir=")), None)
                if sweep is not None:
                    rundir.ensure_writable(Path(sweep), "hydra.sweep.dir")
        except ConfigError as e:
            _fail(str(e))
    sys.argv = [f"kvlab {command}"] + rest
    if command == "plan":
        from kvlab.plan_cmd import hydra_main
    else:
        from kvlab.run_cmd import hydra_main
    try:
        with interrupt.as_exit():  # outside the launcher's watch: composing, or merging after it
            hydra_main()
    except ConfigError as e:  # checks that need more than the config (e.g. the handshake)
        _fail(str(e))
    finally:
        if held is not None:
            rundir.release(held)
    if multirun and command == "run":
        from kvlab.run_cmd import worst_exit

        if worst_exit():  # a job that failed does not stop the sweep, but the sweep reports it
            raise SystemExit(worst_exit())


if __name__ == "__main__":
    main()
