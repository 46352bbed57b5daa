"""``kvlab sim``: a fleet of prefill and decode instances, simulated; ``kvlab sim calibrate RUN...``: its terms.

``kvlab sim [key=value ...]`` is a Hydra app on ``conf/sim.yaml`` (kvlab run's groups, ``cluster=`` and the
``sim.*`` keys; ``-m`` sweeps, e.g. over ``sim.rate``, ``cluster.ctx_instances`` and ``transfer``). It prints
the percentiles and the fleet's figures and writes ``summary.json`` (kvlab.sim.report.TABLE's figures) and
``requests.jsonl`` into its run directory; ``sim.search=true`` first searches the highest rate meeting the
SLOs (``search.json``) and reports the fleet at that rate.

``kvlab sim calibrate RUN... [--name NAME] [--base cpu|h200] [--out PATH]`` fits the terms
(kvlab.sim.calibrate), prints each run's measured and predicted figures and writes the profile
``cost/NAME.yaml`` in the user's config directory (``$XDG_CONFIG_HOME/kvlab``, ``~/.config/kvlab``; never the
package's conf/), or PATH (a ``.yaml`` file, or a directory such as a run directory: its ``cost/NAME.yaml``), which
``cost=NAME`` then gives kvlab sim, kvlab plan and kvlab run's ``predicted_s``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from kvlab.config.schema import CONF_DIR, compose
from kvlab.core.errors import ConfigError
from kvlab.core.paths import user_conf_dir, write_whole
from kvlab.sim import report
from kvlab.sim.run import build_sim, compose_sim, max_rate, run


def _print_result(s, r, which: str = "") -> None:
    """The fleet's table; ``which`` says which rate of a search it describes."""
    c = s.cluster
    w = s.setup.workload
    rate = (f" at {s.sim.rate:.3g} req/s" if s.sim.rate else
            f" at the trace's own rate ({w.trace})" if w.arrival == "trace" else f" ({w.arrival} arrivals)")
    print(f"kvlab sim: {s.setup.model.name}, {s.setup.transfer.strategy.name} over {s.setup.transport.name} "
          f"(terms: {s.terms_name}), {c.ctx_instances} ctx x {s.setup.ctx.size} GPUs -> {c.gen_instances} gen x "
          f"{s.setup.gen.size} GPUs, {r.summary['requests']} requests{rate}{which}")
    for line in report.lines(r.summary, s.sim.percentiles):
        print(line)
    print(f"plan table {r.table_s:.2f} s; event loop {r.outcome.wall_s:.2f} s, {r.outcome.events:,} events, "
          f"{r.outcome.events / max(r.outcome.wall_s, 1e-9):,.0f} events/s")


@hydra.main(config_path=str(CONF_DIR), config_name="sim", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    try:
        simulate(cfg)
    except ConfigError as e:  # here, not in main: Hydra would report it as a job's failure, in ten lines
        print(f"kvlab: error: {e}", file=sys.stderr)
        sys.exit(2)


def simulate(cfg: DictConfig) -> None:
    import dataclasses

    s = build_sim(cfg)
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    which = ""
    if s.sim.search:
        found = max_rate(s)
        write_whole(out / "search.json", json.dumps(found, indent=2))
        print(search_line(s, found))
        shown = found["max_rate"] or min(t["rate"] for t in found["tried"])
        which = (": the highest rate found" if found["bound"] == "=" else ": the highest rate tried"
                 if found["bound"] == ">=" else ": the lowest rate tried, where the SLOs were still missed")
        s = dataclasses.replace(s, sim=dataclasses.replace(s.sim, rate=shown))
    r = run(s)
    if s.sim.search:
        r.summary.update(max_rate=found["max_rate"], max_rate_bound=found["bound"])
    _print_result(s, r, which)
    if s.sim.write_requests:
        rows = report.rows(r.outcome, s.sim.slo)
        write_whole(out / "requests.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    write_whole(out / "summary.json", json.dumps(r.summary, indent=1))  # last: a summary means the rest is there
    print(f"results in {out}")


def search_line(s, found: dict) -> str:
    """The search's answer in one line, with its limits: ">=" where the highest rate tried still met the SLOs, why
    where none did, and the bracket it narrowed to."""
    head = f"highest rate with {s.sim.target:.0%} of requests within the SLOs: "
    n = f"{len(found['tried'])} rates tried"
    if found["bound"] == "=":
        lo, hi = found["bracket"]
        return head + f"{found['max_rate']:.4g} req/s ({hi:.4g} req/s misses them; {n})"
    if found["bound"] == ">=":
        return head + f">= {found['max_rate']:.4g} req/s: {found['why']} ({n})"
    return head + f"none: {found['why']} ({n}, down to {min(t['rate'] for t in found['tried']):.3g} req/s)"


def _check(overrides: list[str], multirun: bool) -> str | None:
    """None if every job composes into a valid simulation, else one line."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        jobs = [overrides]
        if multirun:
            parsed = OverridesParser.create().parse_overrides(overrides)
            jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
        for job in jobs:
            build_sim(compose_sim(job))
    except ConfigError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors, on one line
        return " ".join(str(e).split())
    return None


def writable_file(flag: str, path: Path) -> None:
    """ConfigError naming ``flag`` unless ``path`` can be created or replaced (its directory made if missing)."""
    shown = str(path) if len(str(path)) <= 120 else f"{str(path)[:60]}...({len(str(path))} characters)"
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "a directory is in the way")
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".{path.name[:200]}.probe{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        if len(path.name.encode()) > 255:
            raise OSError(36, "File name too long")
    except OSError as e:
        raise ConfigError(flag, shown, f"cannot be written ({e.strerror or type(e).__name__}); give a writable "
                          "file path") from None


def calibrate_main(argv: list[str]) -> None:
    """``kvlab sim calibrate``; Ctrl-C or SIGTERM is one line saying what it wrote (a traceback before), as in
    ``kvlab sim``."""
    from kvlab.core import interrupt

    written: list[str] = []
    with interrupt.as_exit(functools.partial(_calibrated, written), last=True):
        _calibrate(argv, written)


def _calibrated(written: list[str]) -> str:
    """What an interrupted calibration leaves: each file is written whole, so one it names is complete."""
    if not written:
        return "while calibrating; no profile was written"
    return f"as the calibration ended; {', '.join(written)}"


def _calibrate(argv: list[str], written: list[str]) -> None:
    from kvlab.sim import calibrate

    p = argparse.ArgumentParser(prog="kvlab sim calibrate", description="fit kvlab sim's transfer and prefill terms "
                                "to runs' records and write a cost profile")
    p.add_argument("runs", nargs="+", help="run directories, or results .json files (FILE.json#name,name)")
    p.add_argument("--name", default="fitted", help="profile name, used as cost=NAME")
    p.add_argument("--base", default="cpu", choices=("cpu", "h200"), help="base rates for what has no fitted terms")
    p.add_argument("--out", default=None, help="where to write the profile (default: the user's config directory, "
                   "$XDG_CONFIG_HOME/kvlab/cost/NAME.yaml, ~/.config/kvlab/cost/NAME.yaml without it; "
                   "a run directory keeps it beside its runs: cost=NAME finds it with hydra.searchpath=[file://DIR])")
    p.add_argument("--report", default=None, help="also write each run's figures and errors to this JSON file")
    a = p.parse_args(argv)
    if not a.name or "/" in a.name or a.name in (".", "..") or len(f"{a.name}.yaml".encode()) > 255:
        # the profile is a file named for it, read back as cost=NAME
        print(f"kvlab: error: --name={a.name[:40]}{'...' if len(a.name) > 40 else ''}: a profile's name is its file's "
              "name (NAME.yaml, at most 250 bytes, no '/'); use a short name such as --name my_fit", file=sys.stderr)
        raise SystemExit(2)
    shipped = CONF_DIR / "cost" / f"{a.name}.yaml"
    if shipped.exists() and not a.out:  # the package's conf/ comes first on the searchpath: yours would be unread
        print(f"kvlab: error: --name={a.name}: cost={a.name} is a profile kvlab ships, which cost={a.name} keeps "
              f"reading; name yours otherwise (--name {a.name}_mine), or replace the shipped one in a checkout with "
              f"--out {shipped}", file=sys.stderr)
        raise SystemExit(2)
    out = Path(a.out) if a.out else user_conf_dir() / "cost" / f"{a.name}.yaml"
    if a.out and out.suffix != ".yaml":  # a directory: the profile goes into its cost/, as a group's file
        out = out / "cost" / f"{a.name}.yaml"
    try:
        for flag, place in (("--out", out), ("--report", a.report)):
            if place is not None:  # where the results go is checked before anything is fitted
                writable_file(flag, Path(place))
        fitted, rep, rises = calibrate.calibrate(a.runs)
    except ConfigError as e:
        print(f"kvlab: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for line in calibrate.table_lines(rep):
        print(line)
    for name, t in sorted(fitted.transports.items()):
        print(f"{name}: byte_ns {t.byte_ns:.4g}, staged_byte_ns {t.staged_byte_ns:.4g}, piece_us {t.piece_us:.4g}, "
              f"rtt_us {t.rtt_us:.4g}, host_wait {t.host_wait:.3g}, order_wait {t.order_wait:.3g}, "
              f"prefill_slowdown {t.prefill_slowdown:.3g}")
        print(f"  {calibrate.determination_line(name, rises[name])}")
    pre = fitted.prefill
    print(f"prefill: scale {pre.scale:.4g}, byte_ns {pre.byte_ns:.4g}, fixed_ms {pre.fixed_ms:.4g}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        calibrate.write_profile(out, fitted, a.base, rep, rises)
        written.append(f"its profile is in {out}")
        if a.report:
            write_whole(Path(a.report), json.dumps(rep, indent=1), "--report")
            written.append(f"its report in {a.report}")
    except ConfigError as e:  # no room left since the check above
        print(f"kvlab: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    found = out.parent.parent
    if out.parent.name != "cost":  # a file of its own: a config group's file lies in a cost/ directory
        print(f"profile written to {out} (as cost=NAME from a DIR/cost/NAME.yaml with hydra.searchpath=[file://DIR])")
        return
    how = "" if found.resolve() == user_conf_dir().resolve() else f" hydra.searchpath=[file://{found.resolve()}]"
    print(f"profile written to {out} (cost={out.stem}{how})")


def _kept(held: Path | None, multirun: bool) -> str:
    """What an interrupted simulation leaves: its summary is written last, so it is there only complete."""
    if multirun:
        return "while simulating a sweep; the jobs that ended kept their summaries"
    if held is not None and (held / "summary.json").exists():
        return f"as the simulation ended; its results are in {held}"
    return "while simulating; no summary was written"


def main(argv: list[str]) -> None:
    if argv[:1] == ["calibrate"]:
        return calibrate_main(argv[1:])
    multirun = any(a in ("-m", "--multirun") for a in argv)
    only_looks = any(a in ("--help", "-h", "--cfg", "-c", "--info", "--hydra-help") or a.startswith("--cfg")
                     for a in argv)
    overrides = [a for a in argv if "=" in a and not a.startswith("-") and not a.startswith("hydra.")]
    from kvlab.core import interrupt
    from kvlab.results import rundir

    held = locked = None
    try:
        # composing every job to check it takes seconds of Hydra, where a Ctrl-C was a KeyboardInterrupt traceback
        with interrupt.as_exit("before the simulation started; nothing was simulated or written"):
            if not only_looks:
                problem = _check(overrides, multirun)
                if problem:
                    interrupt.check_pending()  # a Ctrl-C inside Hydra may surface as its error: the signal is the cause
                    print(f"kvlab: error: {problem}", file=sys.stderr)
                    raise SystemExit(2)
            if not only_looks and not multirun:  # one command per directory: a kvlab run there holds it, or this does
                given = next((a.partition("=")[2] for a in argv if a.startswith("hydra.run.dir=")), None)
                held = Path(given) if given is not None else Path(
                    compose(overrides, config_name="sim", return_hydra_config=True).hydra.run.dir)
                if given is None:
                    argv = [*argv, f"hydra.run.dir={held}"]  # pinned: the directory Hydra makes is the one held
                try:
                    rundir.acquire(held)
                    locked = held
                except ConfigError as e:
                    print(f"kvlab: error: {e}", file=sys.stderr)
                    raise SystemExit(2) from None
        sys.argv = ["kvlab sim", *argv]
        with interrupt.as_exit(functools.partial(_kept, held, multirun), last=True):
            hydra_main()
    except ConfigError as e:
        print(f"kvlab: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if locked is not None:
            rundir.release(locked)
