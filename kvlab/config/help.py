"""One line of help per config field, for ``kvlab <command> --help``, read from where each field is defined.

A field's help is the comment on its line in its spec's dataclass, after the comment lines right above
it (``kvlab.config.schema``'s specs and those they nest); a transport's options, which no dataclass holds, take
the comments of their lines in the transport's YAML (conf/transport/). Writing a field's comment is
writing its help: there is no second list to keep in step. ``annotate`` puts the help beside the
composed config as Hydra prints it.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import re
import tokenize
import typing
from pathlib import Path

FIELD = re.compile(r"^(\s*)(\w+)\s*:")
TARGET = "the class Hydra instantiates from this node: a subclass in one's own module may stand here"
# what neither a dataclass nor a group's YAML says of a key: the least of the sources
FALLBACK = {"transfer.strategy._target_": TARGET, "transport._target_": TARGET,
            "transport.name": "the transport's name (conf/transport/), in records and tables"}


def comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in ``cls``'s source (the lines right above it, then the one on its line)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    names = {f.name for f in dataclasses.fields(cls)}
    body = min((len(m.group(1)) for ln in lines[1:] if (m := FIELD.match(ln)) and m.group(2) in names), default=4)
    out: dict[str, str] = {}
    for i, line in enumerate(lines, start=1):
        m = FIELD.match(line)
        if not m or len(m.group(1)) != body or m.group(2) not in names:
            continue
        above, j = [], i - 1
        while j >= 1 and lines[j - 1].strip().startswith("#"):
            above.insert(0, by_line.get(j, ""))
            j -= 1
        text = " ".join(t for t in [*above, by_line.get(i, "")] if t)
        if text:
            out[m.group(2)] = text
    return out


def dataclass_help(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted path (under ``prefix``) -> one line of help, for every field of ``cls`` and of the dataclasses it
    nests that has a comment."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    notes = comments(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if f.name in notes:
            out[path] = notes[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(dataclass_help(hints[f.name], f"{path}."))
    return out


@functools.lru_cache(maxsize=1)
def field_help() -> dict[str, str]:
    """Dotted config path -> one line of help, for every field of the run's config that has a comment."""
    from kvlab.config.schema import Setup

    out = dataclass_help(Setup)
    # nodes the config holds as Hydra objects, not as typed fields: the strategy (transfer.strategy)
    from kvlab.model.schedule import Strategy

    out.update(dataclass_help(Strategy, "transfer.strategy."))
    return out


def yaml_help(path: Path, prefix: str = "") -> dict[str, str]:
    """Dotted path (under ``prefix``) -> the comment of that key in the YAML file ``path``: the comment lines
    right above it, then the one on its line. A group's option file names the fields no dataclass holds."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    stack, above = [], []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            above.append(line.lstrip().lstrip("#").strip())
            continue
        m = FIELD.match(line)
        if not m or m.group(2) == "defaults":
            above = []
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        trailing = line.split(" #", 1)[1].strip() if " #" in line else ""
        text = " ".join(t for t in [*above, trailing] if t)
        if text:
            out[prefix + ".".join(k for _, k in stack)] = text
        above = []
    return out


def option_help(choices) -> dict[str, str]:
    """Dotted path -> help from the option files a composed config chose (``hydra.runtime.choices``: group ->
    option), their comments, over ``FALLBACK``; a spec's own words (``field_help``) go over these."""
    from kvlab.config.schema import CONF_DIR

    helps = dict(FALLBACK)
    for group, option in choices.items():
        path = CONF_DIR / group / f"{option}.yaml"
        if "/" not in group and option and path.is_file() and "@package" not in path.read_text()[:200]:
            helps.update(yaml_help(path, f"{group}."))
    return helps


def annotate(yaml_text: str, helps: dict[str, str], width: int = 120) -> str:
    """``yaml_text`` (OmegaConf's dump of a config) with each field's help after it, on the field's line where it
    fits in ``width`` columns, else on a comment line of its own above it."""
    out, stack = [], []  # stack: (indent, key) of the mappings the current line is in
    for line in yaml_text.splitlines():
        m = FIELD.match(line)
        if not m or line.lstrip().startswith("- "):
            out.append(line)
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        text = helps.get(".".join(k for _, k in stack))
        if text is None:
            out.append(line)
        elif len(line) + 3 + len(text) <= width:
            out.append(f"{line}  # {text}")
        else:
            out.append(f"{m.group(1)}# {text}")
            out.append(line)
    return "\n".join(out)
