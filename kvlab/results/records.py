"""What a run writes and what its readers read: typed records with a schema version.

- ``RankPart``: one rank's part of one request (plain seconds on the shared epoch, kvlab.core.clock);
- ``PartFile``: everything one rank reports after its transfers, ``parts/rank<N>.json``;
- ``RequestRow``: one merged request, a line of ``results.jsonl``;
- ``TimelineRow``: one (request, layer) of a layer-wise run, a line of ``timeline.jsonl``;
- ``Summary``: the run, ``summary.json``.

The figure fields of ``RequestRow`` and ``Summary`` (what moved, when, how fast, the serving
timeline, memory peaks) are not listed here: each is an entry of kvlab.core.figures.TABLE, which says
what it means and how it is computed, and ``_with_figures`` adds its field.

Every record file is written and read here and nowhere else; the one other way a record travels is
kvlab.rank.report, which also hands each rank's ``PartFile`` to rank 0 pickled through torch.distributed's
key-value store, between processes of one run (one version) and never to disk. Each record carries
``schema``, the version it was written under; files written before versions existed read as version 0, with the fields
they lack left at their defaults, so that old results (``results/*.json``) stay readable.
Fields a newer writer added and this reader does not know are dropped on reading. A field renamed
since (a figure's ``was``) reads under its new name; what changed meaning is each figure's
``before`` in kvlab.core.figures, and the record's ``schema`` says which meaning its values have.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvlab.core import figures
from kvlab.core.paths import append_line, write_whole

# bump when a field changes meaning or is removed (adding one with a default needs no bump); 2: delivered GB/s
# and link_ratio over the time in flight (busy_s), the run's span named makespan_s, rows' wire_s named busy_s,
# slot wait on ctx ranks only
SCHEMA = 2

R = TypeVar("R")


def _decode(tp: Any, v: Any) -> Any:
    """A JSON value as the annotated type: nested records, and integer keys JSON turned into strings."""
    if v is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], v) if len(inner) == 1 else v
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, v)
    if origin is list and args:
        return [_decode(args[0], x) for x in v]
    if origin is tuple and args:
        return tuple(_decode(args[0], x) for x in v)
    if origin is dict and args and args[0] is int:
        return {int(k): _decode(args[1], x) for k, x in v.items()}
    # a figure read back is the type it was written as: a string where a number was is a corrupt file
    if tp is float and not (isinstance(v, (int, float)) and not isinstance(v, bool)) \
            or tp is int and not (isinstance(v, int) and not isinstance(v, bool)) \
            or tp is bool and not isinstance(v, bool) or tp is str and not isinstance(v, str):
        raise ValueError(f"{v!r} is not {_TYPE_WORDS[tp]}")
    return v


_TYPE_WORDS = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


def from_dict(cls: type[R], d: dict) -> R:
    """A record from its JSON object (any schema version; unknown keys dropped, missing ones defaulted,
    renamed ones read under their new name)."""
    hints = typing.get_type_hints(cls)
    if d.get("schema", 0) < 2:
        old = {f.was: f.name for f in figures.TABLE if f.was}
        d = {old.get(k, k) if old.get(k) in hints and k not in hints else k: v for k, v in d.items()}
    if not isinstance(d, dict):
        raise ValueError(f"a JSON {type(d).__name__}, not an object")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            try:
                values[f.name] = _decode(hints[f.name], d[f.name])
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{f.name}: {e}") from None
    if "schema" not in d and "schema" in hints:
        values["schema"] = 0
    return cls(**values)


def to_dict(record) -> dict:
    return dataclasses.asdict(record)


def _with_figures(level: str):
    """A dataclass decorator: the class's own fields, then one field per figure of kvlab.core.figures.TABLE at
    ``level`` (``request``: the row of a request figure; ``run``: the Summary field of a run figure), then
    ``schema``."""

    def wrap(cls):
        own = dict(cls.__dict__.get("__annotations__", {}))
        schema = own.pop("schema")
        if level == "request":
            figs = [(f.name, f.default, f.unit) for f in figures.request_figures()]
        else:
            figs = [(f.summary_name, f.run_default, f.unit) for f in figures.run_figures()]
        for name, default, unit in figs:
            if name in own:
                raise TypeError(f"{cls.__name__}.{name}: a figure of kvlab.core.figures.TABLE, not a field of its own")
            own[name] = figures.field_type(default, unit)
            setattr(cls, name, default)
        cls.__annotations__ = {**own, "schema": schema}
        return dataclass(cls)

    return wrap


@dataclass
class DecodeResult:
    """check=decode: one request decoded from its moved cache against the reference (kvlab.rank.decode_check)."""

    tokens: int = 0  # greedy tokens decoded from the moved cache
    equal: int = 0  # of them, equal to the reference's
    max_logit_diff: float | None = None  # largest |logit difference| over the steps
    first_divergent: int | None = None  # first step whose token or logits differ (beyond check.tolerance)
    byte_failures: int = 0  # gen ranks whose byte check of the request failed
    layers: list[int] = field(default_factory=list)  # layers whose rebuilt cache differs from the reference's


@dataclass
class RankPart:
    request: int
    isl: int
    side: str  # ctx | gen
    rank: int  # side-local
    start: float | None = None
    end: float | None = None
    bytes: int = 0
    chunks: int = 0
    in_place: int = 0
    descriptors: int = 0  # memory descriptors this rank's transport posted (nixl: one per WRITE's run)
    copy_s: float = 0.0  # pack (ctx) or unpack (gen) time
    wire: list[tuple[float, float]] = field(default_factory=list)  # (posted, done) per chunk
    prefill_start: float | None = None
    prefill_end: float | None = None
    layer_done: dict[int, float] = field(default_factory=dict)  # global layer -> its last chunk done
    errors: list[str] = field(default_factory=list)
    num_layers: int = 0
    # the serving timeline (kvlab.core.serving): absolute seconds unless named _s
    arrival: float | None = None
    epoch: float | None = None  # the rank's clock epoch: the run's start
    chunks_total: int = 0
    first_post: float | None = None  # its first chunk started on this rank
    slot_wait: float = 0.0  # seconds its chunks waited for a free slot on this rank
    prefill_alone_s: float | None = None  # prefill=gpu: the same prefill with nothing else on the GPU
    layer_ready: dict[int, float] = field(default_factory=dict)  # global layer -> its cache written (ctx)
    fill_s: float = 0.0  # host seconds writing the request's cache (ctx): part of the prefill
    verify_s: float = 0.0  # host seconds checking it (gen): the decode's stand-in
    in_loop: list[str] = field(default_factory=list)  # ["verify"] when the check ran inside the transfer loop
    # peer's side-local rank -> bytes this rank moved with it (empty in parts that do not record it)
    peer_bytes: dict[int, int] = field(default_factory=dict)
    decode: DecodeResult | None = None  # check=decode, on the gen rank that decoded the request
    # prefix reuse (gen, kvlab.model.prefix): bytes of its plan this rank already held; trace blocks hit and looked up
    skipped_bytes: int = 0
    prefix_hit_blocks: int | None = None
    prefix_blocks: int | None = None
    schema: int = SCHEMA

    @property
    def seconds(self) -> float | None:
        return self.end - self.start if self.start is not None and self.end is not None else None

    @property
    def gbps(self) -> float | None:
        """This rank's own: its bytes over the union of its own wire intervals (kvlab.core.figures.rate)."""
        return figures.rate(self.bytes, figures.union(self.wire))


@dataclass
class Peak:
    """Memory of one rank: bytes at the worst moment."""

    staging: int = 0
    extra: int = 0  # extra device memory of the transfer (staging included)
    cache: int = 0
    max_rss: int = 0  # host memory
    free_drop: int = 0  # device free memory lost, NCCL's own buffers included (GPUs)


@dataclass
class Link:
    """The link's speed for a run's own messages, measured in the same run (kvlab.rank.linkrate)."""

    reference: str = "p2p"  # p2p: raw messages over the pair groups; copy: a local copy_ of the same bytes;
    # nixl: raw NIXL WRITEs between the run's agents; mooncake: raw Mooncake writes between its engines
    message_bytes: int = 0
    messages: int = 0  # timed per repeat, all pairs (copy: the chunk-sized pieces, all gen ranks)
    seconds: float = 0.0  # the median repeat's
    gbps: float | None = None  # the median repeat's
    # records written before repeats hold one repeat and none of the fields below
    repeats: int = 1
    gbps_min: float | None = None  # the slowest repeat
    gbps_max: float | None = None  # the fastest: the ceiling a delivered figure is checked against
    bytes: int = 0  # timed per repeat, all ranks
    samples: list[float] = field(default_factory=list)  # GB/s of each repeat
    forms: dict[str, float] = field(default_factory=dict)  # copy: median GB/s of "pieces" and "whole"; each
    # repeat counts the faster of the two
    whole_bytes: int = 0  # copy: bytes of the one-copy form (a request's bytes on one gen rank, bounded)

    def describe(self) -> str:
        """What the reference was, in words, with its median and range: e.g. "4.87 GB/s (median of 3 repeats,
        4.51-5.02) of raw messages of 16.00 MiB between the same ranks"."""
        mib = _mib(self.message_bytes)
        if self.reference == "p2p":
            what = f"raw messages of {mib} between the same ranks"
        elif self.reference == "nixl":
            what = f"raw NIXL WRITEs of {mib} between the same ranks"
        elif self.reference == "mooncake":
            what = f"raw Mooncake writes of {mib} between the same ranks"
        elif self.forms:
            parts = [f"{mib} pieces" + (f" ({self.forms['pieces']:,.2f} GB/s)" if "pieces" in self.forms else ""),
                     f"one copy of {_mib(self.whole_bytes)} per request"
                     + (f" ({self.forms['whole']:,.2f} GB/s)" if "whole" in self.forms else "")]
            what = f"a local copy_ of the same bytes, the faster of {parts[0]} and {parts[1]}"
        else:  # written before the copy reference had two forms
            what = f"a local copy_ of the same {mib} pieces"
        if self.gbps is None:
            return f"no timed figure of {what}"
        if self.repeats > 1 and self.gbps_min is not None and self.gbps_max is not None:
            spread = f"median of {self.repeats} repeats, {self.gbps_min:,.2f}-{self.gbps_max:,.2f}"
        else:
            spread = "one repeat"
        return f"{self.gbps:,.2f} GB/s ({spread}) of {what}"

    @property
    def ceiling(self) -> float | None:
        """The reference's upper figure: its fastest repeat (its one figure in records written before repeats)."""
        return self.gbps_max if self.gbps_max is not None else self.gbps

    def beaten_by(self, delivered_gbps: float | None) -> str | None:
        """One line when ``delivered_gbps`` is above the fastest repeat, else None: the reference was then no
        ceiling for these bytes, and a link_ratio near or above 1 says more about it than the transfer."""
        top = self.ceiling
        if not delivered_gbps or not top or delivered_gbps <= top:
            return None
        return (f"delivered {delivered_gbps:,.2f} GB/s beats the link reference's fastest repeat ({top:,.2f} GB/s: "
                f"{self.describe()}): the reference is no ceiling for these bytes")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


@dataclass
class Env:
    backend: str | None = None
    kernels: str | None = None
    device: str | None = None


@dataclass
class PartFile:
    rank: int  # world rank
    side: str
    side_rank: int
    parts: list[RankPart] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)  # request -> why it failed on this rank
    errors: list[str] = field(default_factory=list)
    error_at: float | None = None  # when the failure that stopped this rank happened
    peak: Peak = field(default_factory=Peak)
    host: str | None = None
    held_blocks: int = 0  # cache blocks still held at the end: 0 when every request freed its own
    node: str | None = None
    env: Env = field(default_factory=Env)
    link: Link | None = None
    schema: int = SCHEMA


@_with_figures("request")
class RequestRow:
    """One request: who served it and whether it arrived whole; its figures are kvlab.core.figures.TABLE's."""

    request: int
    isl: int | None = None
    osl: int | None = None  # tokens it would decode (kvlab.config.workload.output_lengths): carried, not decoded
    ctx_dp: int | None = None
    gen_dp: int | None = None
    verified: bool = False
    error: str | None = None
    in_loop: list[str] = field(default_factory=list)  # ["verify"]: checked inside the transfer loop
    schema: int = SCHEMA


@dataclass
class TimelineRow:
    request: int
    layer: int
    prefill_done_s: float  # since the prefill started
    transfer_done_s: float
    rank: int | None = None  # the ctx rank (side-local) that sent the layer
    schema: int = SCHEMA


@_with_figures("run")
class Summary:
    """The run: what it was and whether it verified; its figures are kvlab.core.figures.TABLE's run figures, and
    ``serving`` holds the percentiles of those with a summary line."""

    verified: bool = False
    requests: int = 0
    failed_requests: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    strategy: str | None = None
    transport: str | None = None
    model: str | None = None
    isl_mean: float = 0.0
    isl_max: int = 0
    slot_bytes: int = 0
    slots: int = 0
    ctx: dict[str, Any] = field(default_factory=dict)  # tp, pp, dp, tokens_per_block, layout
    gen: dict[str, Any] = field(default_factory=dict)
    world_size: int = 0
    backend: str | None = None
    device: str | None = None
    kernels: str | None = None
    torch: str | None = None
    date: str | None = None
    predicted_s: float | None = None
    silent_ranks: list[int] = field(default_factory=list)
    arrival: str | None = None  # burst | poisson | trace
    prefill: str | None = None  # sim | gpu
    serving: dict[str, dict[str, float]] = field(default_factory=dict)  # figure -> p50, ..., mean, std, n
    slo: dict[str, float] = field(default_factory=dict)  # the SLOs set (serving.slo): e.g. {"ttft_ms": 500}
    repeat: int = 0  # which repeat of its config the run is (Setup.repeat)
    interrupted: str | None = None  # the signal that stopped the run (SIGINT, SIGTERM), or None
    completed_requests: list[int] = field(default_factory=list)  # verified, in request order
    link: Link | None = None
    in_loop_requests: dict[str, int] = field(default_factory=dict)  # requests verified inside the loop
    # commit (+dirty), host, load average at the end, versions (kvlab.core.paths.provenance)
    provenance: dict[str, Any] = field(default_factory=dict)
    # ranks_per_gpu (0 on CPUs) and mps: whether processes sharing a GPU ran side by side (kvlab.config.devices)
    gpu_sharing: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA


# ---------------------------------------------------------------- files of a run directory

RESULTS, TIMELINE, SUMMARY = "results.jsonl", "timeline.jsonl", "summary.json"


def part_path(run_dir: Path, world_rank: int) -> Path:
    return Path(run_dir) / "parts" / f"rank{world_rank}.json"


def write_part(run_dir: Path, part: PartFile) -> None:
    path = part_path(run_dir, part.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(to_dict(part)), root=run_dir)  # rank 0 reads it while the others write theirs


def refusal_path(run_dir: Path, world_rank: int) -> Path:
    return Path(run_dir) / "parts" / f"rank{world_rank}.refused"


def write_refusal(run_dir: Path, world_rank: int, message: str) -> None:
    """A rank's ConfigError, for the launcher to say where rank 0 did not meet it (a value only that rank's
    disk or device refuses); best effort: a run directory that cannot take it leaves rank 0's line alone."""
    path = refusal_path(run_dir, world_rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, message, root=run_dir)
    except Exception:  # noqa: BLE001 - the refusal itself is what this rank reports, by its exit code
        pass


def refusals_unsaid(run_dir: Path, world_size: int) -> list[str]:
    """The refusals of ranks other than 0 that rank 0 did not print (it prints its own), one for each field and
    value refused; their files removed (a refused run leaves nothing behind). One run directory that cannot take
    the parts of two ranks is one failure, though each rank names its own file."""
    def what(message: str) -> str:  # ConfigError's "field=value: ..."
        return message.split(": ", 1)[0]

    said = refusal_path(run_dir, 0)
    seen = {what(said.read_text())} if said.exists() else set()
    out = []
    for r in range(world_size):
        path = refusal_path(run_dir, r)
        if not path.exists():
            continue
        if r and what(m := path.read_text()) not in seen:
            seen.add(what(m))
            out.append(m)
        path.unlink()
    with contextlib.suppress(OSError):
        refusal_path(run_dir, 0).parent.rmdir()  # only where nothing else is in it
    return out


def mark_dead(run_dir: Path, world_rank: int) -> None:
    """The local launcher saw ``world_rank`` die: rank 0 need not wait for its part."""
    path = Path(run_dir) / "dead" / f"rank{world_rank}"  # beside parts/, which holds only part files
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def marked_dead(run_dir: Path, world_rank: int) -> bool:
    return (Path(run_dir) / "dead" / f"rank{world_rank}").exists()


def read_part(run_dir: Path, world_rank: int) -> PartFile | None:
    path = part_path(run_dir, world_rank)
    if not path.exists():
        return None
    return from_dict(PartFile, json.loads(path.read_text()))


def _read_jsonl(path: Path, cls: type[R]) -> list[R]:
    if not path.exists():
        return []
    out = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(from_dict(cls, json.loads(line)))
        except (ValueError, RecursionError) as e:  # a truncated line, another program's JSON, a string figure
            raise ValueError(f"{path}: line {i} is not a kvlab {cls.__name__} ({e})") from None
    return out


def _write_jsonl(path: Path, records: list) -> None:
    write_whole(path, "".join(json.dumps(to_dict(r)) + "\n" for r in records))


def write_run(run_dir: Path, rows: list[RequestRow], timeline: list[TimelineRow], summary: Summary) -> None:
    """The run's files, each whole, the summary last: a summary says the rows it counts are there."""
    run_dir = Path(run_dir)
    _write_jsonl(run_dir / RESULTS, rows)
    if timeline:
        _write_jsonl(run_dir / TIMELINE, timeline)
    write_whole(run_dir / SUMMARY, json.dumps(to_dict(summary), indent=2))


def read_rows(run_dir: Path) -> list[RequestRow]:
    return _read_jsonl(Path(run_dir) / RESULTS, RequestRow)


def read_timeline(run_dir: Path) -> list[TimelineRow]:
    return _read_jsonl(Path(run_dir) / TIMELINE, TimelineRow)


def read_summary(run_dir: Path) -> Summary | None:
    """The run's summary, None where it wrote none; ValueError naming the file where it is not one."""
    path = Path(run_dir) / SUMMARY
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
        raise ValueError(f"{path}: not a kvlab summary ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a kvlab summary (a JSON {type(data).__name__}, not an object)")
    if not {f.name for f in dataclasses.fields(Summary)} & set(data):
        raise ValueError(f"{path}: not a kvlab summary (none of its fields)")
    try:
        return from_dict(Summary, data)
    except ValueError as e:  # a figure of the wrong type: the file is named, the run marked by its reader
        raise ValueError(f"{path}: not a kvlab summary ({e})") from None


# ---------------------------------------------------------------- the link curve (kvlab link)

LINK = "link.jsonl"


@dataclass
class LinkPoint:
    """One message size of ``kvlab link`` (kvlab.rank.linkcurve): a line of ``link.jsonl``."""

    transport: str | None = None
    reference: str | None = None  # p2p | nixl | copy: how kvlab.rank.linkrate moved the messages
    size: int = 0  # bytes of one message
    count: int = 0  # messages per pair and repeat
    pairs: int = 0  # (ctx, gen) pairs moving at once
    repeats: int = 0
    time_us: float | None = None  # the median repeat's time per message on a pair
    algbw: float | None = None  # one pair's GB/s, median repeat
    algbw_min: float | None = None
    algbw_max: float | None = None
    busbw: float | None = None  # every pair together, median repeat
    samples: list[float] = field(default_factory=list)  # algbw of each repeat
    wrong: int | None = None  # bytes that arrived different in the checked round; None: nothing checked
    schema: int = SCHEMA


def start_link(run_dir: Path) -> None:
    """No ``link.jsonl`` of an earlier run in ``run_dir``: its sizes would count as this run's."""
    (Path(run_dir) / LINK).unlink(missing_ok=True)


def append_link(run_dir: Path, point: LinkPoint) -> None:
    """One size's line, on disk as soon as it is measured: an interrupted ``kvlab link`` keeps the sizes it has."""
    append_line(Path(run_dir) / LINK, json.dumps(to_dict(point)))


def read_link(run_dir: Path) -> list[LinkPoint]:
    return _read_jsonl(Path(run_dir) / LINK, LinkPoint)


# ---------------------------------------------------------------- benchmark reports (scripts/bench.py)

@dataclass
class BenchTransfer:
    """One transfer of a benchmark report, next to the raw link measured in the same run."""

    name: str
    summary: Summary
    overrides: list[str] = field(default_factory=list)
    requests: list[RequestRow] = field(default_factory=list)
    wall_s: float | None = None
    raw_nccl_gbps: float | None = None
    ratio_to_raw: float | None = None
    extra_over_staging: float | None = None
    extra_over_cache: float | None = None
    schema: int = SCHEMA


@dataclass
class BenchReport:
    date: str | None = None
    device: str | None = None
    gpus: int | None = None
    torch: str | None = None
    nccl: str | None = None
    cuda: str | None = None
    transfers: list[BenchTransfer] = field(default_factory=list)
    raw_nccl: dict[str, Any] = field(default_factory=dict)  # message bytes -> seconds, GB/s
    kernels: dict[str, Any] | None = None  # scripts/kernel_bench.py's report, when run with the transfers
    schema: int = SCHEMA


def write_bench(path: Path, report: BenchReport, field: str = "--out") -> None:
    write_whole(Path(path), json.dumps(to_dict(report), indent=2), field)


def read_bench(path: Path) -> BenchReport:
    return from_dict(BenchReport, json.loads(Path(path).read_text()))
