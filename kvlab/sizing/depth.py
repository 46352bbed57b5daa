"""How many of the model's layers ``prefill=model`` runs where ``model.run_layers`` is 0: the whole model where it
fits in every GPU's memory beside the pools, else the largest prefix of whole layers that does.

The launcher decides it before any rank starts and hands the ranks the config with the cut in it
(``model.run_layers``), so that both sides and the reference cut the same layers; one line says so. Each
GPU's free memory is read in a child process: a CUDA context in the launcher would hold its share of the
device for the whole run. Under torchrun no launcher runs: a model that does not fit is refused there, as
any explicit ``model.run_layers`` that does not fit is everywhere, in one line naming the value that fits
(kvlab.sizing.budget).
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvlab.config import devices
from kvlab.config.schema import Setup
from kvlab.core.errors import ConfigError
from kvlab.sizing import budget

PROBE_S = 120.0  # the child that reads the GPUs' free memory: importing torch and creating a context per GPU
# a rank's CUDA context on its GPU (about 0.5 GiB on an H200): the ranks read the free memory the budget checks with
# every rank's context made, the probe with its own alone (one H200, four ranks: 125.4 GiB usable to the probe,
# 124.0 to the ranks)
CONTEXT_BYTES = 600 << 20
PROBE = "import torch; print(*(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())))"


@dataclass(frozen=True)
class Cut:
    """``layers`` of the model's ``of`` run; ``line``: what the launcher prints."""

    layers: int
    of: int
    line: str


def gpu_free() -> list[int] | None:
    """Free bytes of each visible GPU, read in a child process; None where it cannot be read (the ranks' own
    check then decides)."""
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return [int(x) for x in out.stdout.split()] if out.returncode == 0 else None
    except ValueError:
        return None


def _fits(setup: Setup, free: list[int], b: budget.Budget | None = None) -> bool:
    """Whether ``setup``'s ranks fit ``free`` (its budget ``b`` where already estimated)."""
    b = budget.estimate(setup, len(free)) if b is None else b
    b.available = {f"cuda:{i}": budget.usable(f) for i, f in enumerate(free)}
    try:
        budget.check(setup, b)
    except ConfigError:
        return False
    return True


def fit(setup: Setup, layers_of: Callable[[int], Setup], whole: int, free: list[int]) -> Cut | None:
    """The cut of a ``prefill=model`` run whose whole model (``whole`` layers) does not fit in ``free`` (bytes per
    GPU) beside the pools; None where it fits whole, or where not even one layer fits (the budget's check then
    refuses the run in its own words). ``layers_of(n)``: the run's setup with ``model.run_layers=n``."""
    def fits(n: int) -> bool:
        try:
            return _fits(layers_of(n), free)
        except ConfigError:  # a depth the run cannot take (fewer layers than pipeline stages)
            return False

    least = max(setup.ctx.pp, setup.gen.pp)  # a layer per pipeline stage at least
    b = budget.estimate(setup, len(free))  # the whole model's: checked, then named in the line
    if _fits(setup, free, b) or least >= whole or not fits(least):
        return None
    lo, hi = least, whole  # lo fits, hi does not: the need grows with every layer
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    memory = max((r.memory for r in b.ranks), key=lambda m: sum(b.need(m).values()))
    need = sum(b.need(memory).values())
    name = setup.model.name.removesuffix("-model")
    return Cut(lo, whole, f"prefill=model runs the first {lo} of {name}'s {whole} layers, the most that fit beside "
                          f"the pools: all {whole} need {budget.fmt(need)} of {memory}, "
                          f"{budget.fmt(budget.usable(free[int(memory.split(':')[1])]))} available; "
                          f"model.run_layers={lo} on both sides and in the reference (set it to choose)")


def auto(setup: Setup, layers_of: Callable[[int], Setup], whole: int) -> Cut | None:
    """``fit`` for a run the launcher starts on this host's GPUs, where the model's depth is left to kvlab."""
    if setup.prefill.kind != "model" or setup.model.run_layers or devices.gpu_count(setup) == 0:
        return None
    free = gpu_free()
    if not free:
        return None
    b = budget.estimate(setup, len(free))
    sharing = [sum(r.memory == f"cuda:{i}" for r in b.ranks) for i in range(len(free))]
    return fit(setup, layers_of, whole, [max(0, f - max(0, n - 1) * CONTEXT_BYTES) for f, n in zip(free, sharing)])
