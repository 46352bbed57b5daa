"""The options of kvlab's config groups, and the check that a group is chosen by one of them.

Hydra looks a group's choice up as a file name; a choice that is no file (a typo, or 10,000 characters that the
filesystem refuses to stat) must be one line naming the group and its options, on every path that composes a
config (``kvlab run``/``plan``/``link``, ``kvlab sim``, the Python API), before Hydra sees it."""
from __future__ import annotations

import re
from pathlib import Path

from kvlab.core.errors import ConfigError
from kvlab.core.paths import CONF_DIR, user_conf_dir


def group_names() -> list[str]:
    """Every group of conf/ (a folder of YAML files): run's groups, and sim's cluster."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def search_dirs(overrides) -> list[Path]:
    """The DIRs of ``hydra.searchpath=[file://DIR,...]`` overrides."""
    return [Path(d) for s in overrides if "searchpath" in s for d in re.findall(r"file://([^,\]\s'\"]+)", s)]


def group_options(group: str, search: list[str] = ()) -> list[str]:
    """The options of a config group: its YAML files in conf/, in the user's (kvlab.core.paths.user_conf_dir)
    and in the ``hydra.searchpath`` DIRs, which replace the user's as they do in Hydra."""
    given = search_dirs(search)
    dirs = [CONF_DIR, *(given if search else [user_conf_dir()])]
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


def check_group_choices(overrides) -> None:
    """ConfigError for the first ``group=choice`` (``+group=``, ``++group=``) whose choice is none of the group's
    options; ``hydra.searchpath`` overrides among ``overrides`` add their DIRs' options."""
    search = [o for o in overrides if "searchpath" in o]
    groups = set(group_names())
    for ov in overrides:
        m = re.fullmatch(r"\+{0,2}(\w+)=(.*)", ov, flags=re.S)
        if m and m.group(1) in groups:
            group, value = m.groups()
            if "," in value or value.startswith(("choice(", "range(", "glob(")):
                continue  # a sweep over choices (-m): each job's choice is checked when it is composed
            options = group_options(group, search)
            if value not in options:
                shown = value if len(value) <= 60 else f"{value[:40]}... ({len(value)} characters)"
                raise ConfigError(group, shown, f"unknown {group}; choose one of {', '.join(options)}")
