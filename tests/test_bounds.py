"""Bounds stated on the spec fields (kvlab.core.bounds): each value the issue found unbounded ends as one
``kvlab:`` line naming the field, the value and what would work, exit 2, before any rank starts and with no run
directory left; the walk reads every field from the dataclasses, so a field added later is covered too."""
from __future__ import annotations

import dataclasses
import time

import pytest

from kvlab.cli.commands import check_overrides
from kvlab.config.schema import Setup
from kvlab.core import bounds
from kvlab.core.errors import ConfigError

BIG = str(2**63)

# (command, overrides, what the line must say)
UNBOUNDED = [
    ("run", ["check=decode", "model=tiny_gqa", "check.tokens=100000000"], ["check.tokens=100000000", "1024"]),
    ("run", ["check=decode", "model=tiny_gqa", f"check.seed={BIG}"], [f"check.seed={BIG}", "4294967295"]),
    ("run", [f"workload.seed={BIG}"], [f"workload.seed={BIG}"]),
    ("run", [f"workload.isl={BIG}"], [f"workload.isl={BIG}"]),
    ("sim", ["cluster.links.nic.gbit_s=1e-300"], ["cluster.links.nic.gbit_s=1e-300", "0 (off)"]),
    ("sim", ["sim.rate=1e-300"], ["sim.rate=1e-300", "requests/s"]),
    ("sim", ["sim.rate=nan"], ["sim.rate=nan", "finite"]),
    ("sim", ["cluster.gpu.tflops=inf"], ["cluster.gpu.tflops=inf", "finite"]),
    ("link", ["link.max_bytes=1000000000000"], ["link.max_bytes=1000000000000", "2^32"]),
    ("link", ["link.max_bytes=1e12"], ["link.max_bytes=1e12", "integer"]),
    ("link", [f"link.min_bytes={2**63 - 1}"], [f"link.min_bytes={2**63 - 1}", "2^32"]),
    ("link", ["link.min_bytes=3"], ["link.min_bytes=3", "one token row", ">= 192"]),
    ("run", ["transfer.timeout_s=inf"], ["transfer.timeout_s=inf"]),
    ("run", ["prefill.layer_ms=nan"], ["prefill.layer_ms=nan", "finite"]),
    ("run", ["fault.stall_s=1e300"], ["fault.stall_s=1e+300"]),
    ("run", ["workload.trace=" + "x" * 5000], ["workload.trace=", "5000 characters"]),
]


def _problem(command: str, overrides: list[str]) -> str | None:
    if command != "sim":
        return check_overrides(overrides)
    from kvlab.sim.cmd import _check

    return _check(overrides, multirun=False)


@pytest.mark.parametrize("command,overrides,words", UNBOUNDED, ids=[" ".join(o)[:40] for _, o, _ in UNBOUNDED])
def test_unbounded_values_are_one_line_naming_the_field(command, overrides, words):
    problem = _problem(command, overrides)
    assert problem is not None and "\n" not in problem
    for w in words:
        assert w in problem, (w, problem)


def test_every_int_and_float_field_has_its_type_range():
    """A field of any group, bounded or not, refuses a value its type cannot carry (the walk is the dataclasses')."""
    seen = 0
    for name, f, tp in bounds.fields(Setup):
        scalar, _, _ = bounds.leaf_types(tp)
        if scalar is int:
            with pytest.raises(ConfigError, match=rf"^{name}=\d+: "):
                bounds.check_value(name, f, tp, 2**63)
            seen += 1
        elif scalar is float:
            with pytest.raises(ConfigError, match=rf"^{name}=nan: "):
                bounds.check_value(name, f, tp, float("nan"))
            seen += 1
    assert seen > 50


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = bounds.bounded(1.0, lo=0.5, hi=2.0, unit="x")


@dataclasses.dataclass(frozen=True)
class Group:
    inner: Inner = dataclasses.field(default_factory=Inner)
    count: int = 1


def test_a_new_field_is_walked_without_being_listed():
    assert [n for n, _, _ in bounds.fields(Group, "g.")] == ["g.inner.rate", "g.count"]
    with pytest.raises(ConfigError, match=r"^g.inner.rate=3.0: must be in \[0.5, 2\] x$"):
        bounds.check_tree(Group, {"inner": {"rate": 3.0}}, "g.")
    with pytest.raises(ConfigError, match=r"^g.count="):
        bounds.check_tree(Group, {"count": -(2**64)}, "g.")


@pytest.mark.slow
@pytest.mark.parametrize("command,overrides", [
    ("link", ["link.min_bytes=3"]), ("link", ["link.max_bytes=1e12"]), ("link", [f"link.min_bytes={2**63 - 1}"]),
    ("sim", ["sim.rate=1e-300"]), ("sim", ["cluster.links.nic.gbit_s=1e-300"]), ("run", ["workload.rate=nan"]),
    ("run", ["check=decode", "model=tiny_gqa", "check.tokens=100000000"]),
    ("run", ["check=decode", "model=tiny_gqa", f"check.seed={2**63 + 1}"])])
def test_cli_refuses_before_any_directory(kvlab_cli, tmp_path, command, overrides):
    start = time.monotonic()
    out = kvlab_cli(command, *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    took = time.monotonic() - start
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlab: ") and overrides[-1] in lines[0], out.stderr
    assert not (tmp_path / "run").exists()
    print(f"{command} {' '.join(overrides)}: ended in {took:.1f} s")
