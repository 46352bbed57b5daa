"""``kvlab <command> [hydra flags] [overrides]``: plan | run | link.

Overrides are checked before Hydra starts, so a bad one ends in one line naming the field,
the value and what would work (exit code 2), before any rank starts or any memory is taken.
The arguments are read with Hydra's own parser, so every Hydra flag means what it means to a
Hydra app; the ones that only look (``--help``, ``--hydra-help``, ``--cfg``, ``--info``, ``-sc``)
leave no run directory behind.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

from kvlab.core.errors import ConfigError, one_line_warnings, printable

COMMANDS = {
    "plan": "what a setup would move per (ctx rank -> gen rank), its predicted time and memory; writes plan.json",
    "run": "start the ranks, move and verify every request's KV cache; results in the run directory",
    "link": "the link curve of the setup's own ranks and transport over message sizes, as nccl-tests prints it",
    "sim": "a fleet of prefill and decode instances simulated on the plan; kvlab sim calibrate RUN... fits its terms",
}
GROUPS = ("model", "transfer", "transport", "workload", "prefill", "logger", "parallel", "experiment", "cost")
HELP = """usage: kvlab <command> [-m] [key=value ...]

commands:
{commands}

kvlab <command> --help lists the config groups and the config; Hydra's flags work as in any Hydra app
(--cfg job, --info, -m for a sweep, --hydra-help lists them; -sc install=bash completes them).
e.g. kvlab plan model=llama3_8b ctx.tp=4 gen.tp=2
     kvlab run transfer=layerwise workload.requests=8
"""
# Hydra's default app help, with the groups kvlab lists (its ConfigStore's base_* schemas are not choices)
HELP_TEMPLATE = """kvlab {command}: {what}

== Configuration groups ==
Compose your configuration from those groups (group=option; experiment with +experiment=, for -m)

{groups}

== Config ==
Override anything in the config (foo.bar=value)

$CONFIG

Hydra's flags: kvlab {command} --hydra-help; kvlab's commands: kvlab --help
"""


def usage() -> str:
    return HELP.format(commands="\n".join(f"  {name:<6} {what}" for name, what in COMMANDS.items()))


def hydra_message(exc: BaseException, overrides: list[str] = ()) -> str:
    text = str(exc) + ("\n" + str(exc.__cause__) if exc.__cause__ else "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    flat = "; ".join(dict.fromkeys(lines))
    return _plain_message(flat, overrides) or flat


def _keys_of(path: list[str]) -> list[str] | None:
    """Keys of the structured config node at ``path`` (None when it is not a known dataclass)."""
    import dataclasses
    import typing

    from kvlab.config.schema import Config

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
    base, value = printable(base), printable(value)
    if m := re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", flat):
        return f"{base}={value}: use one of {m.group(2)}"
    if "is not a valid bool" in flat:
        return f"{base}={value}: must be true or false"
    if m := re.search(r"could not be converted to (\w+)", flat):
        kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(m.group(1), m.group(1))
        where = f" (element {key[len(base):]})" if key != base else ""
        return f"{base}={value}: must be {kind}{where}"
    if base.startswith("transport.") and "not in struct" in flat:  # Hydra would advise +transport.<key>
        line = _transport_option(base, value, overrides)
        if line:
            return line
    if m := re.search(r"Key '(\w+)' not in '(\w+)'", flat):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        keys = _keys_of(parent.split(".") if parent else [])
        options = f"; {parent or 'the config'} has {', '.join(keys)}" if keys else ""
        return f"{base}={value}: no such key{options}"
    return None


def _transport_option(key: str, value: str, overrides: list[str]) -> str | None:
    """What the chosen transport says of an option it does not have (its class lists those it takes)."""
    from omegaconf import OmegaConf

    from kvlab.config.schema import CONF_DIR, TransportSpec

    name = next((ov.partition("=")[2] for ov in overrides if re.fullmatch(r"\+?transport=\w+", ov)), "auto")
    path = CONF_DIR / "transport" / f"{name}.yaml"
    if not path.is_file():
        return None
    node = OmegaConf.to_container(OmegaConf.load(path))
    node[key.split(".", 1)[1]] = value
    try:
        TransportSpec.of(node).cls()
    except ConfigError as e:
        return str(e)
    return None


def validate_overrides(overrides: list[str], search: list[str] = (), memory: bool = False,
                       command: str = "run", moves: bool = False) -> None:
    """Raise ConfigError (or Hydra's composition error) unless the overrides compose into a valid setup for
    ``command`` (that fits this host's memory, with ``memory``: kvlab.sizing.budget; whose transport's package is
    installed, with ``moves``: bytes will move); ``search``: ``hydra.searchpath=[file://DIR,...]`` overrides, whose
    DIRs hold a user's own group files."""
    from kvlab.config.schema import build, compose
    from kvlab.core.checks import check_overrides_shape
    from kvlab.sizing import budget

    check_overrides_shape(overrides)
    cfg = compose([*search, *overrides])  # a group chosen by a name it lacks: one line (kvlab.config.groups)
    setup = build(cfg)
    if moves:
        setup.check_installed()
    if command == "link":  # the ranks' own config: slots as large as the largest message
        from kvlab.cli.link_cmd import for_link

        setup = build(for_link(cfg))
    if memory:  # before the plan: a huge workload.requests is refused, not built
        budget.check_host(setup)
    if setup.needs_preflight:  # fault positions and capacities that only the plan can check
        from kvlab.sizing.preflight import preflight

        preflight(setup)


def check_overrides(overrides: list[str], search: list[str] = (), memory: bool = False,
                    command: str = "run", moves: bool = False) -> str | None:
    """None if the overrides compose into a valid setup (validate_overrides), else one line saying what is wrong."""
    try:
        validate_overrides(overrides, search, memory, command, moves)
    except ConfigError as e:
        return str(e)
    except Exception as e:  # Hydra's own composition errors: keep their words, on one line
        return hydra_message(e, overrides)
    return None


def sweep_points(overrides: list[str], search: list[str] = ()) -> list[list[str]]:
    """The overrides of every job ``-m`` would run: the sweep in the config (``hydra.sweeper.params``,
    set by an experiment) and on the command line, expanded the way Hydra's basic sweeper does."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvlab.config.schema import compose

    parser = OverridesParser.create()
    fixed = [o.input_line for o in parser.parse_overrides(overrides) if not o.is_sweep_override()]
    head = compose([*search, *fixed], return_hydra_config=True)
    params = head.hydra.sweeper.get("params") or {}
    parsed = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _check_sweep(overrides: list[str], search: list[str], memory: bool, command: str = "run",
                 moves: bool = False) -> str | None:
    try:
        jobs = sweep_points(overrides, search)
    except ConfigError as e:
        return str(e)
    except Exception as e:  # a sweep Hydra cannot parse: its words, on one line
        return hydra_message(e, overrides)
    for job in jobs:
        problem = check_overrides(job, search, memory, command, moves)
        if problem:
            return problem + (f" (in the sweep job {' '.join(job)})" if len(jobs) > 1 else "")
    return None


def _run_dir(rest: list[str]) -> Path:
    """The run directory Hydra will use: ``hydra.run.dir`` as given, or the default of conf/config.yaml."""
    for a in rest:
        if a.startswith("hydra.run.dir="):
            # as Hydra reads it: a quoted path loses its quotes (taken as they are, they named another directory)
            from hydra.core.override_parser.overrides_parser import OverridesParser

            try:
                return Path(str(OverridesParser.create().parse_override(a).value()))
            except Exception:  # Hydra says what is wrong with it when it composes
                return Path(a.partition("=")[2])
    from kvlab.config.schema import compose

    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    return Path(compose(overrides, return_hydra_config=True).hydra.run.dir)


def _fail(problem: str, code: int = 2):
    from kvlab.core.interrupt import check_pending

    check_pending()  # a Ctrl-C that broke a library mid-call made this problem: the interruption is the one line
    print(f"kvlab: error: {problem}", file=sys.stderr)
    raise SystemExit(code)


class _BadArguments(Exception):
    pass


def _parser(command: str):
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.prog = f"kvlab {command}"

    def error(message: str):  # argparse's usage block would bury the one line that matters
        raise _BadArguments(message)

    parser.error = error
    return parser


def check_arguments(given: list[str]) -> str | None:
    """One line for an argument Hydra would refuse only after making the run directory: a word that is no
    ``key=value`` (an unquoted value with spaces, split by the shell) or a value its grammar cannot read
    unquoted (non-ASCII characters, parentheses)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for i, a in enumerate(given):
        if "=" not in a and not a.startswith("~"):
            before = given[i - 1] if i else ""
            hint = (f"; a value with spaces must be quoted for the shell and for Hydra, e.g. \"{before.split('=')[0]}="
                    f"'{before.partition('=')[2]} {a}'\"" if "=" in before else "; overrides are key=value")
            return f"{a}: not an override{hint}"
        try:
            parser.parse_override(a)
        except Exception:  # noqa: BLE001 - Hydra's grammar error is several lines about its parser
            key, _, value = a.partition("=")
            return (f"{key}={value}: Hydra's override grammar cannot read this value unquoted (spaces, non-ASCII "
                    f"characters, parentheses); quote it: \"{key}='{value}'\"")
    return None


def parse_args(command: str, rest: list[str]):
    """``rest`` as the Hydra app will read it (hydra._internal.utils.get_args_parser): its flags, and its
    ``overrides`` (the positionals: ``-sc install=bash``'s value is one of them). Overrides may stand on
    both sides of a flag (``kvlab run logger=quiet -m ctx.tp=1,2``), which Hydra alone refuses."""
    return _parser(command).parse_intermixed_args(rest)


def hydra_argv(command: str, args, overrides: list[str]) -> list[str]:
    """The arguments for the Hydra app: the overrides, then the flags as parsed. In this order no
    override can be read as a flag's value (``--info``'s is optional) nor come after a flag, which
    Hydra's parser refuses."""
    flags = []
    for action in _parser(command)._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or value == action.default:
            continue
        flags += [action.option_strings[0]] if action.nargs == 0 else [action.option_strings[0], str(value)]
    return [*overrides, *flags]


def looks_only(args) -> bool:
    """Whether Hydra will only print (help, config, info, shell completion) and run no job."""
    return bool(args.help or args.hydra_help or args.cfg or args.info or args.shell_completion)


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def help_overrides(command: str, search: list[str], overrides: list[str] = ()) -> list[str]:
    """Hydra's ``--help`` with kvlab's group list (the options a user can name, not the schemas behind them) and
    the config composed from ``overrides``, each field with its line of help (kvlab.config.help)."""
    from kvlab.config.groups import group_options, search_dirs
    from kvlab.config.schema import CONF_DIR

    dirs = [CONF_DIR, *search_dirs(search)]
    names = sorted({*GROUPS, *(g.name for d in dirs if d.is_dir() for g in d.iterdir() if g.is_dir())})
    lines = [f"{g}: {', '.join(opts)}" for g in names if (opts := group_options(g, search))]
    text = HELP_TEMPLATE.format(command=command, what=COMMANDS[command], groups="\n".join(lines))
    config = _annotated_config([*search, *overrides])
    if config is not None:  # else Hydra's own dump of it
        text = text.replace("$CONFIG", config.replace("$", "$$"))
    return [f"hydra.help.template={_quoted(text)}"]


def _annotated_config(overrides: list[str]) -> str | None:
    """The composed config as Hydra prints it, with every field's help beside it; None if it does not compose."""
    from omegaconf import OmegaConf

    from kvlab.config import help as config_help
    from kvlab.config.schema import compose

    try:
        full = compose(overrides, return_hydra_config=True)
    except Exception:  # noqa: BLE001 -- Hydra says what is wrong when it composes the same again
        return None
    helps = config_help.option_help(full.hydra.runtime.choices)
    helps.update(config_help.field_help())  # the spec's own words come first
    cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])
    return config_help.annotate(OmegaConf.to_yaml(cfg).rstrip(), helps)


def _hydra_main(command: str):
    if command == "plan":
        from kvlab.cli.plan_cmd import hydra_main
    elif command == "link":
        from kvlab.cli.link_cmd import hydra_main
    else:
        from kvlab.cli.run_cmd import hydra_main
    return hydra_main


def complete(words: list[str]) -> None:
    """``-sc install=bash`` and the rest of Hydra's shell completion, for ``kvlab <command>``: the script is
    installed for ``kvlab``, and its queries (``COMP_LINE="kvlab run mo"``) go to that command's app without
    the command word, which Hydra would read as an override."""
    line = os.environ.get("COMP_LINE", "")
    parts = line.split()
    query = any(w.startswith("query=") for w in words)
    if query and not (len(parts) > 2 or len(parts) == 2 and line.endswith(" ")):
        word = parts[1] if len(parts) == 2 else ""
        print(" ".join(c for c in COMMANDS if c.startswith(word)))
        return
    command = parts[1] if query and parts[1] in COMMANDS else "run"
    if query:
        rest = line.split(command, 1)[1]
        os.environ["COMP_LINE"] = "kvlab" + rest
        if "COMP_POINT" in os.environ:
            os.environ["COMP_POINT"] = str(max(0, int(os.environ["COMP_POINT"]) - len(line) + len("kvlab" + rest)))
    sys.argv = ["kvlab", "-sc", *words]  # the script completes the command as typed: kvlab
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            _hydra_main(command)()
        except SystemExit:
            pass
    text = out.getvalue()
    if query:  # the ConfigStore's schemas are no option to type
        text = " ".join(w for w in text.split() if not re.search(r"(^|=)base_", w)) + "\n"
    sys.stdout.write(text)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    one_line_warnings()
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage(), end="")
        return
    if argv[:1] in (["-sc"], ["--shell-completion"]):
        return complete(argv[1:])
    if not argv:
        print(usage(), end="", file=sys.stderr)
        raise SystemExit(2)
    if argv[0] not in COMMANDS:
        what = "no such option" if argv[0].startswith("-") else "no such command"
        _fail(f"{argv[0]}: {what}; use one of {', '.join(COMMANDS)} (kvlab --help says what each does)")
    from kvlab.core import interrupt

    if argv[0] == "sim":  # its own Hydra app (conf/sim.yaml) and its calibrate subcommand
        with interrupt.as_exit("before the simulation started; nothing was simulated or written"):
            interrupt.import_held("torch")  # a signal raised inside torch's C start-up aborts the process
            from kvlab.sim.cmd import main as sim_main

            problem = None if argv[1:2] == ["calibrate"] else check_arguments(  # not Hydra's flags (-m, --cfg)
                [*(known := _parser("sim").parse_known_args(argv[1:]))[0].overrides, *known[1]])
        if problem:
            _fail(problem)
        return sim_main(argv[1:])
    from kvlab.results import rundir

    command, rest = argv[0], argv[1:]
    held = None
    with interrupt.as_exit("before any rank started"):  # Ctrl-C or SIGTERM while starting: one line
        interrupt.import_held("torch")  # a signal raised inside torch's C start-up aborts the process
        try:
            args = parse_args(command, rest)
        except _BadArguments as e:
            _fail(f"{e}; kvlab {command} --hydra-help lists the flags")
        if args.shell_completion:
            return complete(args.overrides)
        multirun = bool(args.multirun)
        problem = check_arguments(args.overrides)
        if problem:
            _fail(problem)
        overrides = [a for a in args.overrides if (a.startswith("~") or "=" in a) and not a.startswith("hydra.")]
        search = [a for a in args.overrides if a.startswith("hydra.searchpath=")]
        running = not looks_only(args)  # nothing will start, so no memory to check and no directory to hold
        memory = command in ("run", "link") and running
        moves = command in ("run", "link") and running  # plan and the looks (--help, --cfg) move no bytes
        problem = (_check_sweep(overrides, search, memory, command, moves) if multirun
                   else check_overrides(overrides, search, memory, command, moves))
        if problem:
            _fail(problem)
        given = list(args.overrides)
        if args.help:
            given += help_overrides(command, search, overrides)
        try:
            if running and not multirun and (command == "plan" or int(os.environ.get("RANK", 0)) == 0):
                # one run per directory, locked before Hydra writes anything there; pinned, so that the
                # directory Hydra creates is the one locked (the default names it after the clock)
                held = _run_dir(args.overrides)
                if not any(a.startswith("hydra.run.dir=") for a in args.overrides):
                    given.append(f"hydra.run.dir={held}")
                rundir.acquire(held)
            elif running and multirun:
                sweep = next((a.partition("=")[2] for a in args.overrides if a.startswith("hydra.sweep.dir=")), None)
                if sweep is not None:
                    rundir.ensure_writable(Path(sweep), "hydra.sweep.dir")
        except ConfigError as e:
            _fail(str(e))
    sys.argv = [f"kvlab {command}", *hydra_argv(command, args, given)]
    hydra_main = _hydra_main(command)
    try:
        with interrupt.as_exit(last=True):  # outside the launcher's watch: composing, or merging after it
            hydra_main()
    except ConfigError as e:  # checks that need more than the config (e.g. the handshake)
        _fail(str(e))
    finally:
        if held is not None:
            rundir.release(held)
    if multirun and command == "run" and running:
        from kvlab.cli.run_cmd import worst_exit

        if worst_exit():  # a job that failed does not stop the sweep, but the sweep reports it
            raise SystemExit(worst_exit())


if __name__ == "__main__":
    main()
