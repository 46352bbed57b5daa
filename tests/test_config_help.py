"""One line of help per config field, read from where the field is defined (kvlab.config.help)."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from kvlab.config import help as config_help
from kvlab.config.schema import compose


@dataclass(frozen=True)
class Example:
    plain: int = 1
    noted: int = 2  # on its line
    # above it,
    # over two lines
    both: str = "x"  # and on its line
    # a comment that ends before a blank line belongs to nobody

    nested: tuple = ()


def test_a_field_takes_the_comments_above_it_and_on_its_line():
    assert config_help.comments(Example) == {"noted": "on its line",
                                             "both": "above it, over two lines and on its line"}


def test_annotate_puts_each_help_on_its_fields_line_or_above_it():
    text = "a:\n  b: 1\n  c: 2\nd:\n- 1\n- 2\n"
    got = config_help.annotate(text, {"a.b": "short", "a.c": "x" * 200, "d": "a list"}, width=60)
    assert got.splitlines() == ["a:", "  b: 1  # short", f"  # {'x' * 200}", "  c: 2", "d:  # a list", "- 1", "- 2"]


def test_every_field_of_the_run_config_has_help():
    helps = {**config_help.FALLBACK, **config_help.field_help()}
    cfg = compose([])
    leaves = [k for k in _leaves(OmegaConf.to_container(cfg)) if not k.startswith("extra")]
    assert helps["fault.freeze_rank"].startswith("world rank that stops itself")
    assert helps["repeat"].startswith("which repeat")
    assert [k for k in leaves if k not in helps] == []  # a new field needs its comment


def _leaves(node, prefix=""):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_run_help_shows_the_fields_help_and_the_transports_own(kvlab_cli, tmp_path):
    p = kvlab_cli("run", "--help", "transport=mooncake", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert any(ln.startswith("  freeze_rank: -1  # ") or ln.strip().startswith("# world rank that stops itself")
               for ln in lines), p.stdout
    assert any(ln.startswith("  mode: staged  # staged: one write per chunk through registered slots")
               for ln in lines), p.stdout
    assert not list(tmp_path.iterdir())  # help runs nothing and writes nothing
