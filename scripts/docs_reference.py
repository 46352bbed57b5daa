"""The site's reference pages, generated from the code when the site is built (mkdocs-gen-files runs this;
``mkdocs.yml``): every config field with its help line (the comment where it is defined:
kvlab.config.help, what ``kvlab run --help`` prints) and its default, every figure of
kvlab.core.figures.TABLE, one API page per package for mkdocstrings, and the notebooks as pages."""
from __future__ import annotations

import importlib
import pkgutil
from enum import Enum
from pathlib import Path

import mkdocs_gen_files
import yaml
from omegaconf import OmegaConf

from kvlab.config import help as config_help
from kvlab.config.groups import group_options
from kvlab.config.schema import CONF_DIR, compose
from kvlab.core import figures

ROOT = Path(__file__).resolve().parents[1]
# kvlab's layers, top down (the import contract in pyproject.toml)
PACKAGES = ["api", "analysis", "cli", "sim", "rank", "sizing", "transports", "memory", "results", "config", "model",
            "core"]


NODE = object()  # a mapping: its row says what it holds, its fields follow


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def shown(value) -> str:
    """A default as one writes it in an override (YAML: null, true, an enum by name)."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, enum_to_str=True)
    text = yaml.safe_dump(value.name if isinstance(value, Enum) else value, default_flow_style=True, width=10**6)
    return f"`{text.strip().removesuffix('...').strip()}`"


def flat(cfg, prefix: str = "") -> dict[str, object]:
    """Dotted path -> default, for every leaf of a composed config (lists are leaves)."""
    out = {}
    for key in cfg:
        value = cfg[key] if not OmegaConf.is_missing(cfg, key) else "???"
        path = f"{prefix}{key}"
        if OmegaConf.is_dict(value):
            out[path] = NODE
            out.update(flat(value, f"{path}."))
        else:
            out[path] = value
    return out


def options(group: str) -> str:
    """A group's options as ``kvlab run --help`` lists them (base_* are the schemas behind them)."""
    return ", ".join(f"`{n}`" for n in group_options(group) if not n.startswith("base_"))


def table(rows: dict[str, object], helps: dict[str, str], top: str) -> list[str]:
    out = ["| field | default | what it means |", "| --- | --- | --- |"]
    for path, value in rows.items():
        if path.split(".")[0] != top or (value is NODE and (path not in helps or path == top)):
            continue
        default = "(the fields below)" if value is NODE else cell(shown(value))
        out.append(f"| `{path}` | {default} | {cell(helps.get(path, ''))} |")
    return out


def config_page() -> str:
    full = compose([], return_hydra_config=True)
    helps = config_help.option_help(full.hydra.runtime.choices)
    helps.update(config_help.field_help())
    cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])
    rows = flat(cfg)
    lines = ["# Config reference", "",
             "Generated from the code when the site is built: every field of the config `kvlab run`, `kvlab plan` "
             "and `kvlab link` compose, with its default and its help line: the comment where the field is "
             "defined (its spec's dataclass in `kvlab.config.schema` and the specs it nests, or the option's YAML "
             "under `conf/`), which is also what `kvlab run --help` prints beside the composed config. Units are "
             "in the field's name (`_ms`, `_mib`, `_s`, `_gbps`) or its help line. `kvlab run --help model=NAME "
             "transport=NAME` shows the fields and defaults a given choice composes.", ""]
    tops = list(dict.fromkeys(p.split(".")[0] for p in rows))
    lines += [f"Groups: {', '.join(f'[`{t}`](#{t})' for t in tops)}; [each transport's own options]"
              "(#each-transports-own-options); [`kvlab sim`](#kvlab-sim-the-cluster-and-the-simulator).", ""]
    for top in tops:
        lines += [f"## `{top}` {{#{top}}}", ""]
        if options(top):
            lines += [f"Options (`{top}=NAME`, `conf/{top}/`): {options(top)}.", ""]
        lines += [*table(rows, helps, top), ""]
    lines += ["## Each transport's own options", "",
              "A transport's options are the keys of its file under `conf/transport/` (constructor arguments, "
              "checked against its signature); their help is the comment on each key.", ""]
    for path in sorted((CONF_DIR / "transport").glob("*.yaml")):
        if path.stem.startswith("base_"):
            continue
        c = compose([f"transport={path.stem}"])
        trows = {k: v for k, v in flat(c.transport, "transport.").items()}
        th = dict(config_help.FALLBACK)
        th.update(config_help.yaml_help(path, "transport."))
        lines += [f"### `transport={path.stem}`", "", *table(trows, th, "transport"), ""]
    lines += sim_section()
    return "\n".join(lines) + "\n"


def sim_section() -> list[str]:
    import kvlab.sim.run  # noqa: F401 -- registers the schema conf/sim.yaml composes on (base_sim)
    from kvlab.sim.cluster import ClusterSpec, SimSpec

    full = compose([], config_name="sim", return_hydra_config=True)
    helps = config_help.option_help(full.hydra.runtime.choices)
    helps.update(config_help.yaml_help(CONF_DIR / "sim.yaml"))
    helps.update(config_help.field_help())
    helps.update(config_help.dataclass_help(ClusterSpec, "cluster."))
    helps.update(config_help.dataclass_help(SimSpec, "sim."))
    cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])
    rows = flat(cfg)
    lines = ["## `kvlab sim`: the cluster and the simulator", "",
             "`kvlab sim` composes `conf/sim.yaml`: kvlab run's groups (above, with the defaults that file sets) "
             "plus these two.", ""]
    for top in ("cluster", "sim"):
        lines += [f"### `{top}`", ""]
        if options(top):
            lines += [f"Options (`{top}=NAME`, `conf/{top}/`): {options(top)}.", ""]
        lines += [*table(rows, helps, top), ""]
    return lines


def figures_page() -> str:
    lines = ["# Figures reference", "",
             "Generated from `kvlab.core.figures.TABLE` when the site is built: every figure a run reports, its "
             "unit, what it means and how it is made. A request figure is a field of each row of `results.jsonl` "
             "(`kvlab.results.records.RequestRow`); a run figure one of `summary.json` (`Summary`, under its run "
             "name). The terminal shows the figures with a column in its table of requests, and the percentiles "
             "of those with a label.", "",
             "Units: " + "; ".join(f"`{u}` shown as {d[2] or 'a number'}" for u, d in figures.DISPLAY.items()) + ".",
             "", cell(figures.__doc__.split("\n\n")[0]), "",
             "| figure | unit | meaning | how it is made | per request | run figure | terminal | needs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in figures.TABLE:
        run = f.summary_name or ""
        how_run = f" ({f.run})" if isinstance(f.run, str) else ""
        shown_as = "; ".join(x for x in (f.column and f"column {f.column}", f.line and f"percentiles: {f.line}") if x)
        lines.append(f"| `{f.name}` | {f.unit} | {cell(f.meaning)} | {cell(f.how)} | "
                     f"{'yes' if f.request else ''} | {f'`{run}`{how_run}' if run else ''} | {cell(shown_as)} | "
                     f"{f.needs or ''} |")
    return "\n".join(lines) + "\n"


def modules(package: str) -> list[str]:
    pkg = importlib.import_module(f"kvlab.{package}")
    if not hasattr(pkg, "__path__"):
        return [pkg.__name__]
    found = [pkg.__name__]
    for m in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
        found.append(m.name)
    return found


def api_pages() -> None:
    index = ["# Python API", "",
             "Generated from the docstrings when the site is built, one page per package, top layer first "
             "(a package imports only those below it: `pyproject.toml`'s import contract). The seams' "
             "protocols are their modules' docstrings: `kvlab.transports`, `kvlab.rank.executor`, "
             "`kvlab.model.schedule`.", "", "| package | what it holds |", "| --- | --- |"]
    for package in PACKAGES:
        mods = modules(package)
        doc = (importlib.import_module(mods[0]).__doc__ or "").strip().split("\n\n")[0]
        index.append(f"| [`kvlab.{package}`]({package}.md) | {cell(doc)} |")
        body = [f"# `kvlab.{package}`", ""]
        for m in mods:
            body += [f"::: {m}", ""]
        with mkdocs_gen_files.open(f"reference/api/{package}.md", "w") as fh:
            fh.write("\n".join(body))
    with mkdocs_gen_files.open("reference/api/index.md", "w") as fh:
        fh.write("\n".join(index) + "\n")


def notebooks() -> None:
    """The notebooks as pages, as committed (the test suite executes them: tests/test_notebooks.py)."""
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        with mkdocs_gen_files.open(f"notebooks/{nb.name}", "wb") as fh:
            fh.write(nb.read_bytes())


with mkdocs_gen_files.open("reference/config.md", "w") as fh:
    fh.write(config_page())
with mkdocs_gen_files.open("reference/figures.md", "w") as fh:
    fh.write(figures_page())
api_pages()
notebooks()
