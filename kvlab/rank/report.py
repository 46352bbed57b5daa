"""How every rank's results reach rank 0 when some rank may be dead or stalled.

After its transfers a rank writes ``parts/rank<N>.json`` in the run directory (what it moved,
which of its requests failed and why) and posts the same through the key-value store that
torch.distributed already uses for rendezvous. No collective runs after the transfers: a
collective with a dead member waits for it until the process group's timeout, and ranks
that left the transfer loop at different moments could pair up in different collectives.

Liveness instead of timeouts on the whole run: every rank bumps a counter in the store
while it makes progress (each chunk, each fill or verify piece, each poll here), and a
thread on rank 0 watches the counters from the start of the transfers, so that silence is
measured from when it began. Rank 0 waits for a rank's part as long as its counter moves; a
counter that stands still for ``stale_s`` (the transfer timeout plus a margin: a healthy rank
completes or fails a chunk within the timeout) marks the rank as dead or stalled, and rank 0
goes on without it. The other ranks wait the same way for rank 0's verdict. A store that
cannot be reached (rank 0, which hosts it under ``kvlab run``, died) ends the exchange at
once; the part files remain, and the launcher merges them. A rank told to stop (SIGTERM)
writes its part file and leaves; rank 0, told to stop, merges the part files it finds.

``finalize`` is that merge, wherever the parts come from (the store, the run directory, or only
the files when rank 0 died and the launcher merges): every request the run planned is either
verified by all of its gen ranks or failed with the most likely reason.
"""
from __future__ import annotations

import pickle
import re
import sys
import threading
import time
from pathlib import Path

from kvlab.config.devices import gpu_sharing
from kvlab.config.workload import RunPlan
from kvlab.core import figures
from kvlab.core.decode_spec import check_line
from kvlab.core.errors import ConfigError
from kvlab.model.schedule import Ready
from kvlab.rank import store_pieces
from kvlab.results import metrics, rundir, sweep_table
from kvlab.results.records import Env, PartFile, marked_dead, read_part, write_run
from kvlab.transports.deadline import call_within

PREFIX = "kvlab/"


def wait_for_parts(run_dir: Path, ranks, wait_s: float) -> tuple[dict[int, PartFile], list[int]]:
    """Part files of ``ranks`` as they appear in a shared run dir, for up to ``wait_s``; (parts, missing)."""
    deadline = time.monotonic() + wait_s
    got: dict[int, dict] = {}
    while True:
        for r in ranks:
            if r not in got and (part := read_part(run_dir, r)) is not None:
                got[r] = part
        if len(got) == len(ranks) or time.monotonic() > deadline:
            return got, [r for r in ranks if r not in got]
        time.sleep(0.1)


def stale_s(setup) -> float:
    """Silence after which a rank counts as dead or stalled: a healthy rank completes or fails a chunk
    within the transfer timeout, and shows progress between chunks (kvlab.rank.report)."""
    return setup.transfer.timeout_s + 5.0


class Board:
    def __init__(self, store, rank: int, world: int, stale_s: float, beat_every_s: float = 0.5):
        self.store, self.rank, self.world, self.stale_s = store, rank, world, stale_s
        self.beat_every_s = beat_every_s
        self.broken: str | None = None  # why the store stopped answering
        self._last = 0.0
        self._seen: dict[int, tuple] = {}  # rank -> (last beat count, monotonic time it changed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.gone = lambda r: False  # rank r is known dead (the launcher said so): no use waiting for it
        self.beat(force=True)

    def watch(self) -> None:
        """Rank 0: start observing every other rank's beats. Elsewhere nothing: a thread that polls a store
        whose host (rank 0) has gone would only print the store's complaints, even while its rank stalls."""
        if self.rank != 0:
            return
        now = time.monotonic()
        self._seen = {r: (None, now) for r in range(self.world) if r != self.rank}
        threading.Thread(target=self._watch_loop, name="kvlab-beats", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch_loop(self) -> None:
        while not self._stop.is_set() and self.broken is None:
            for r in list(self._seen):
                self._observe(r)
            self._stop.wait(0.5)

    def _observe(self, r: int) -> None:
        count = self._call(self.store.add, f"{PREFIX}beat/{r}", 0)
        with self._lock:
            if r not in self._seen or count != self._seen[r][0]:
                self._seen[r] = (count, time.monotonic())

    def silent_for(self, r: int) -> float:
        with self._lock:
            return time.monotonic() - self._seen[r][1]

    def _call(self, fn, *args):
        if self.broken is not None:
            return None
        try:
            # a frozen host (stopped, not dead) keeps the connection open and never answers
            return call_within(fn, *args, timeout_s=self.stale_s, what="the store's host (rank 0)")
        except Exception as e:  # the store's host is gone: every later call would fail the same way
            self.broken = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return None

    def beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.beat_every_s:
            self._last = now
            self._call(self.store.add, f"{PREFIX}beat/{self.rank}", 1)

    def post(self, part: PartFile) -> None:
        # a long run's part passes the store's 8 MiB a value
        self._call(store_pieces.put, self.store, f"{PREFIX}part/{self.rank}", pickle.dumps(part))

    def refuse(self, e: ConfigError) -> None:
        """Any rank but 0 that cannot keep its part (a disk with room for rank 0's only): rank 0 would wait out
        ``stale_s`` for it, and a full disk may have no room for the file that says why either."""
        said = pickle.dumps((e.field, e.value, e.hint))  # a ConfigError does not unpickle (its three arguments)
        self._call(store_pieces.put, self.store, f"{PREFIX}refused/{self.rank}", said)

    def _get(self, key: str):
        if self._call(self.store.check, [PREFIX + key]):
            raw = self._call(store_pieces.get, self.store, PREFIX + key)
            return None if raw is None else pickle.loads(raw)
        return None

    def _wait(self, keys: dict[int, str]) -> tuple[dict, list[int]]:
        """The value each rank puts under its key (rank -> key), giving up on a rank whose beat stands
        still for ``stale_s``; (values by rank, ranks given up on)."""
        got, silent = {}, []
        pending = set(keys)
        for r in pending:
            if r not in self._seen:  # not watched from the start: silence counts from now
                self._observe(r)
        while pending and self.broken is None:
            for r in sorted(pending):
                value = self._get(keys[r])
                if value is not None:
                    got[r] = value
                    pending.discard(r)
                    continue
                refused = self._get(f"refused/{r}")
                if refused is not None:  # the run stops as on rank 0's own refusal, said by rank 0 alone
                    raise ConfigError(*refused)
                self._observe(r)
                if self.silent_for(r) > self.stale_s or self.gone(r):
                    silent.append(r)
                    pending.discard(r)
            self.beat()
            if pending:
                time.sleep(0.05)
        return got, sorted(silent + sorted(pending))

    def collect(self) -> tuple[dict[int, PartFile], list[int]]:
        """Rank 0: (part of every other rank that reported, ranks that went silent)."""
        return self._wait({r: f"part/{r}" for r in range(self.world) if r != self.rank})

    def publish(self, verdict: dict, readers: list[int], ack_wait_s: float = 10.0) -> None:
        """Rank 0: the run's verdict; waits a little for the readers, so that a store hosted by this
        process outlives their reading it."""
        self._call(store_pieces.put, self.store, f"{PREFIX}verdict", pickle.dumps(verdict))
        deadline = time.monotonic() + ack_wait_s
        keys = [f"{PREFIX}ack/{r}" for r in readers]
        while keys and time.monotonic() < deadline and self.broken is None:
            if self._call(self.store.check, keys):
                return
            time.sleep(0.05)

    def await_verdict(self) -> dict | None:
        """Any rank but 0: rank 0's verdict, or None when rank 0 went silent or the store is gone."""
        got, _ = self._wait({0: "verdict"})
        if 0 in got:
            self._call(self.store.set, f"{PREFIX}ack/{self.rank}", b"1")
            return got[0]
        return None


def rank_name(setup, w: int) -> str:
    side, rank = setup.side_of(w)
    return f"{side.name}{rank}"


def finalize(setup, run_dir: Path, plan: RunPlan, gathered: dict[int, PartFile], silent: list[int],
             why_silent: str, predicted_s: float | None = None, interrupted: str | None = None):
    """Merge the parts that arrived into results.jsonl, summary.json and the table; returns the Summary.
    A request counts as verified only when every gen rank it targets (in the run's ``plan``) reported all
    of its chunks and found them exact."""
    requests, order = plan.requests, plan.order
    all_parts = [p for w in sorted(gathered) for p in gathered[w].parts]
    failures = {k: v for w in sorted(gathered) for k, v in gathered[w].failures.items()}
    # the likely cause first: silent ranks (their peers' timeouts follow from them), then by time
    errors = [f"{rank_name(setup, w)} (rank {w}) sent no report: "
              f"{'its process ended (the launcher saw it)' if marked_dead(run_dir, w) else why_silent}"
              for w in silent]
    by_time = sorted(gathered, key=lambda w: (gathered[w].error_at is None, gathered[w].error_at or 0, w))
    errors += [e for w in by_time for e in gathered[w].errors]
    expected: dict[tuple[int, int], int] = {}
    for c in order:
        expected[(c.request, c.dst)] = expected.get((c.request, c.dst), 0) + 1
    got = {(p.request, p.rank): p.chunks for p in all_parts if p.side == "gen"}
    for (rid, dst), n in sorted(expected.items()):
        w = setup.world_rank("gen", dst)
        if rid in failures:
            continue
        if w not in gathered:
            failures[rid] = f"gen{dst} (rank {w}) sent no report"
        elif got.get((rid, dst), 0) < n:
            why = f": {errors[0]}" if errors else ""
            failures[rid] = f"gen{dst} received {got.get((rid, dst), 0)} of {n} chunks (run stopped{why})"
    traits = figures.Traits.of(setup.transport.cls(), setup.transport.options)
    rows, timeline = metrics.merge(all_parts, failures, {r.id: r.ctx_dp for r in requests},
                                   {r.id: r.gen_dp for r in requests}, setup.transfer.strategy.ready == Ready.layer,
                                   traits, order, setup.serving.slo)
    isl = {r.id: r.isl for r in requests}
    osl = {r.id: r.osl for r in requests}
    for row in rows:
        row.isl = row.isl or isl.get(row.request)
        row.osl = osl.get(row.request)
    env = gathered[min(gathered)].env if gathered else None
    link = next((g.link for _, g in sorted(gathered.items()) if g.link), None)
    summary = metrics.summarize(rows, all_parts, setup, [g.peak for g in gathered.values()],
                                env or Env(), errors, predicted_s, silent, link, traits, order)
    summary.interrupted = interrupted
    summary.gpu_sharing = gpu_sharing(setup)
    summary.completed_requests = [r.request for r in rows if r.verified]
    write_run(run_dir, rows, timeline, summary)
    if rundir.sweep_dir(run_dir) is None:
        metrics.print_table(rows, summary)
    else:  # a sweep's job: one line; the sweep's closing table has them all (kvlab.cli.sweep_end)
        print(sweep_table.job_line(summary), flush=True)
        check = check_line(rows)
        if check:
            print(check, flush=True)
    broken = metrics.violations(rows, summary, all_parts, order, pulls=setup.transport.cls().pulls)
    if broken:  # a measuring or merging bug, not the transfer's: the figures above are suspect
        more = f" (and {len(broken) - 3} more)" if len(broken) > 3 else ""
        print(f"kvlab: the figures break their identities (kvlab.core.figures): {'; '.join(broken[:3])}{more}",
              file=sys.stderr)
    if not interrupted:  # an interrupted run's errors are its interruption: the launcher says it in one line
        # a rank the launcher saw die or killed frozen is its line's to name: what its peers and its part say of it
        # (a deadline run out on it, no report from it) stays in summary.json
        dead = [re.compile(rf"\b({rank_name(setup, w)}|rank {w})\b") for w in range(setup.world_size)
                if marked_dead(run_dir, w)]
        for e in errors:
            if not any(d.search(e) for d in dead):
                print(f"kvlab: {e}", file=sys.stderr)
    print(f"results in {run_dir}")
    return summary


def finalize_from_files(setup, run_dir: Path, plan: RunPlan, predicted_s: float | None = None,
                        interrupted: str | None = None):
    """The local launcher's merge when rank 0 wrote no summary (it died, or the run was interrupted):
    the part files, with every request that did not arrive whole reported failed."""
    gathered = {w: p for w in range(setup.world_size) if (p := read_part(run_dir, w)) is not None}
    if not gathered and not interrupted:
        return None
    silent = [w for w in range(setup.world_size) if w not in gathered]
    return finalize(setup, run_dir, plan, gathered, silent, "dead or stopped", predicted_s, interrupted)

