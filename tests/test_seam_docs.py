"""Every seam's protocol says what the code has: each call its docstring names (``name(arg, ...)``, ``obj.attr`` on a
parameter of a protocol method) exists, with those argument names, and the transports it lists are the ones
``conf/transport/`` offers.

A seam is an abstract base class in kvlab (``abc.ABC``); its protocol is its docstring, or its module's where the
class points there ("see the protocol at the top of this module"): the numbered steps under ``Protocol.``.
"""
from __future__ import annotations

import abc
import ast
import importlib
import inspect
import pkgutil
import re
import textwrap
import typing
from pathlib import Path

import pytest

import kvlab
from kvlab.core.paths import CONF_DIR

CALL = re.compile(r"``(?:cls\.|self\.)?([A-Za-z_][\w.]*)\(([^()`]*)\)(?:\s*->[^`]*)?``")
ATTR = re.compile(r"``([a-z_]\w*)\.([A-Za-z_][\w.]*)(?:\[[^`]*\])?``")


def seams() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(kvlab.__path__, "kvlab."):
        if info.name.endswith("__main__"):  # running it is what importing it does
            continue
        try:
            mod = importlib.import_module(info.name)
        except ImportError:  # an optional extra's module: its seam, if any, is checked where it is installed
            continue
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__ and abc.ABC in cls.__bases__:
                found.append(cls)
    return found


def protocol_text(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if "protocol at the top of this module" in doc:
        doc = inspect.getdoc(inspect.getmodule(cls)) or ""
    if "Protocol." not in doc:
        return doc
    paragraphs = [p.strip() for p in doc.split("Protocol.", 1)[1].split("\n\n")]
    # the numbered steps and their continuation lines, up to the first paragraph after them
    first = next(i for i, p in enumerate(paragraphs) if p.startswith("1."))
    steps = [paragraphs[first]]
    for p in paragraphs[first + 1:]:
        if not re.match(r"\d+\.", p):
            break
        steps.append(p)
    return "\n\n".join(steps)


def _namespace(cls: type) -> dict:
    """The module's names and those it imports only for type checking, so that annotations resolve."""
    mod = inspect.getmodule(cls)
    ns = dict(vars(mod))
    tree = ast.parse(Path(mod.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom):
                    src = importlib.import_module(imp.module)
                    ns.update({a.asname or a.name: getattr(src, a.name) for a in imp.names})
    return ns


def _params(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _hints(owner, ns: dict) -> dict:
    try:
        return typing.get_type_hints(owner, globalns=ns)
    except Exception:  # noqa: BLE001 - an annotation this check cannot resolve: no chain through it
        return {}


def _instance_attrs(owner: type) -> set[str]:
    """What the class's methods assign to ``self`` (``self.tables = ...`` in ``__init__``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}


def problems(cls: type) -> list[str]:
    text = protocol_text(cls)
    ns = _namespace(cls)
    out = []
    typed: dict[str, type] = {}  # a protocol method's parameter -> its annotated type, for ``param.attr``
    for name, args in CALL.findall(text):
        head, _, rest = name.partition(".")
        if rest:  # a call on a parameter: resolved below with the attributes
            continue
        fn = cls.__init__ if name == cls.__name__ else getattr(cls, name, None)
        if fn is None:
            out.append(f"{cls.__name__}: the protocol names {name}(), which it does not have")
            continue
        have = _params(fn)
        said = [a.strip().split("=")[0].strip() for a in args.split(",") if a.strip()]
        for a in said:
            if not a.startswith("*") and a not in have:
                out.append(f"{cls.__name__}.{name}: the protocol names the argument {a}, the code has {have}")
        for p, t in _hints(fn, ns).items():
            if isinstance(t, type):
                typed.setdefault(p, t)
    for m in [*ATTR.finditer(text), *CALL.finditer(text)]:
        base, path = (m.group(1), m.group(2)) if m.re is ATTR else (m.group(1).split(".")[0],
                                                                    ".".join(m.group(1).split(".")[1:]))
        if base not in typed or not path:
            continue
        owner = typed[base]
        for attr in path.split("."):
            fields = {**_hints(owner, ns), **dict(inspect.getmembers(owner))}
            if attr not in fields and attr not in _instance_attrs(owner):
                out.append(f"{cls.__name__}: the protocol names {base}.{path}, and {owner.__name__} has no {attr}")
                break
            nxt = _hints(owner, ns).get(attr)
            nxt = next((a for a in typing.get_args(nxt) if isinstance(a, type) and a is not type(None)), nxt)
            if not isinstance(nxt, type):
                break
            owner = nxt
    return out


def test_there_are_seams_to_check():
    names = {c.__name__ for c in seams()}
    assert "Transport" in names


@pytest.mark.parametrize("cls", seams(), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_a_seams_protocol_names_what_the_code_has(cls):
    assert protocol_text(cls).strip(), f"{cls.__name__}: no protocol in its docstring"
    assert problems(cls) == []


def test_the_transport_seam_lists_the_transports_conf_offers():
    from kvlab import transports

    doc = transports.__doc__
    offered = sorted(p.stem for p in (CONF_DIR / "transport").glob("*.yaml"))
    assert [t for t in offered if f"``{t}``" not in doc] == []


class _Ctx:
    cache: int = 0


class _Broken(abc.ABC):
    """Protocol.

    1. ``connect(executor)``: once; it reads ``executor.cache``.
    2. ``start(i, chunk)``: a chunk.
    3. ``gone()``: never.
    4. ``finish(ctx)``: reads ``ctx.cache`` and ``ctx.clock``.
    """

    @abc.abstractmethod
    def connect(self, ctx: _Ctx) -> None: ...

    @abc.abstractmethod
    def start(self, i, c) -> None: ...

    @abc.abstractmethod
    def finish(self, ctx: _Ctx) -> None: ...


def test_the_check_fails_on_a_protocol_that_names_what_is_not_there():
    """The check itself: a seam whose steps name a missing method, a wrong argument and a missing attribute."""
    said = problems(_Broken)
    assert any("connect: the protocol names the argument executor" in p for p in said)
    assert any("start: the protocol names the argument chunk" in p for p in said)
    assert any("names gone()" in p for p in said)
    assert any("names ctx.clock, and _Ctx has no clock" in p for p in said)
    assert not any("ctx.cache" in p for p in said)
