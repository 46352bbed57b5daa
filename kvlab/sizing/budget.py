"""What each rank will hold, and whether the machine can give it, before anything is allocated.

Per world rank: the cache (every pool, as ``PagedCache`` sizes it: the blocks of the requests
open at the worst moment plus the canaries, or ``cache.capacity_tokens``), the staging slots
(or the naive baseline's per-chunk buffers; none for a pulling transport), the block tables, the temporaries of fill and
verify, the plan (every rank holds the whole global chunk order) and the process itself. On
a CPU all of it comes from host memory; on a GPU the first four come from its device (plus
NCCL's own buffers) and the rest from the host. With ``prefill=model`` every rank also holds the model
(``model``: its bf16 weights, unsharded, and the activations and transformers cache of a forward over the
longest prompt), on the device where the cache is. The figures are upper bounds computed without
building the request list: at most ``workload.concurrency + transfer.slots`` requests are open
on a rank at once (a request stays open until ``slots`` chunks after its last), each at most
the longest prompt the workload can produce; its chunks are counted from one planned request
of that length. A run whose ranks need more than a memory can give (host: MemAvailable less a
margin; GPU: free memory less a margin) stops with one line naming the field that makes it
too large, the bytes needed and available, and a value of that field that fits.
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field

from kvlab.config.schema import Setup
from kvlab.core.errors import ConfigError
from kvlab.core.paths import room_fix
from kvlab.memory.cache import verify_piece_bytes
from kvlab.model.parallel import SideSpec
from kvlab.model.plan import Request, plan
from kvlab.model.schedule import Cut, Staging
from kvlab.model.state import CacheState

# Host bytes per element of the plan every rank keeps (measured with tracemalloc over plan_run of
# 240 lognormal requests, 97120 chunks: 384 B per chunk, segments and requests included)
CHUNK_BYTES = 400
REQUEST_BYTES = 400
# CPU seconds every rank spends planning the run (kvlab.config.workload.plan_run) before its first transfer, per request
# and per chunk of the budget's bound (measured on one core: 4000 requests of 128 tokens 1.1 s, 2000 of 2048
# tokens over 2 DP groups 0.55 s, 200 of 32768 tokens 0.07 s); a run whose planning alone passes PLAN_MAX_S is
# refused, as its interruption would wait for it
PLAN_S_PER_REQUEST, PLAN_S_PER_CHUNK, PLAN_MAX_S = 2.5e-4, 1e-5, 60.0
PROCESS_BYTES = 200 << 20  # a rank's own memory: interpreter, torch, gloo (measured: 160 MiB private after imports)
FILL_PIECE_FACTOR = 16  # fill/verify temporaries per byte of a 16 MiB piece (measured: 229 MiB peak)
FILL_PIECE_BYTES = 16 << 20
NCCL_BYTES = 1 << 30  # NCCL's own device buffers per rank (measured on H200: about 0.8 GiB)
DEVICE_PARTS = ("cache", "staging", "tables", "temps", "transport", "model", "check")  # on the GPU when there is one
MARGIN_SHARE, MARGIN_MIN = 0.10, 512 << 20  # kept free: the kernel, other processes, estimates' slack
# what a run writes into its run directory, upper bounds (measured on tiny_gqa, 4 layers: a results row 1.1 KB,
# a part entry 1.1 KB a request and rank, 25 B of it per layer, a layerwise timeline row 135 B; 1000000 requests
# wrote 0.88 GB of results): config, logs and summary, then per request a results row, a part entry on each
# rank and a timeline row per layer
RUN_DIR_FIXED_BYTES = 1 << 20
RESULT_ROW_BYTES, PART_ROW_BYTES, PART_LAYER_BYTES, TIMELINE_ROW_BYTES = 1536, 1536, 32, 160


@dataclass
class RankNeed:
    world_rank: int
    name: str  # ctx0, gen1, ...
    memory: str  # where cache and staging live: "host" or "cuda:<index>"
    cache: int
    staging: int
    tables: int
    temps: int
    plan: int
    process: int = PROCESS_BYTES
    transport: int = 0  # NCCL's buffers on a GPU
    model: int = 0  # prefill=model: weights and a forward's activations (``model_bytes``)
    check: int = 0  # check=decode on a gen rank: its requests' reference planes and received shares (``check_bytes``)

    def parts(self) -> dict[str, int]:
        return {"cache": self.cache, "staging": self.staging, "tables": self.tables, "temps": self.temps,
                "transport": self.transport, "model": self.model, "check": self.check, "plan": self.plan,
                "process": self.process}

    def on(self, memory: str) -> dict[str, int]:
        """The parts of this rank that come from ``memory``."""
        return {k: v for k, v in self.parts().items() if (self.memory if k in DEVICE_PARTS else "host") == memory}


@dataclass
class Budget:
    ranks: list[RankNeed]
    open_requests: int  # requests a rank may hold at once, at most
    longest: tuple[str, object, int]  # (field, value, tokens) of the longest prompt
    chunks_per_request: int
    available: dict[str, int] = field(default_factory=dict)  # memory -> usable bytes, once measured

    def need(self, memory: str) -> dict[str, int]:
        """Bytes per part that the ranks take from ``memory`` together."""
        out: dict[str, int] = {}
        for r in self.ranks:
            for k, v in r.on(memory).items():
                out[k] = out.get(k, 0) + v
        return out

    def memories(self) -> list[str]:
        return sorted({r.memory for r in self.ranks} | {"host"})

    def to_dict(self) -> dict:
        return {"ranks": [dict(rank=r.world_rank, name=r.name, memory=r.memory, **r.parts()) for r in self.ranks],
                "open_requests": self.open_requests, "chunks_per_request": self.chunks_per_request,
                "need": {m: sum(self.need(m).values()) for m in self.memories()}, "available": dict(self.available)}


def model_bytes(setup: Setup, tokens: int) -> tuple[int, int]:
    """(weights, activations) in bytes of prefill=model's forward over ``tokens`` (0, 0 for another prefill).
    Activations: the residual stream and a layer's projections and MLP at once (bf16), the transformers cache of
    every layer and its copy as pool planes, and the last position's logits; eager attention (gpt-oss) adds its
    scores, and DeepSeek-V3.2's indexer its per-head scores (measured: 16 GiB at 8k tokens, twice at once)."""
    if setup.prefill.kind != "model":
        return 0, 0
    from kvlab.model.hf_config import weight_bytes

    m, d = setup.model, setup.model.dims
    qk = d.qk_head_dim or m.head_dim
    mlp = max(d.intermediate_size, d.experts_active * d.moe_intermediate_size)
    layer = 2 * tokens * (4 * d.hidden_size + 3 * d.q_heads * qk + 3 * mlp)
    cache = 2 * planes_bytes(m, tokens)
    scores = 4 * d.q_heads * tokens * tokens if m.decode.family == "gpt_oss" else 0
    if m.indexer:  # transformers' DSA indexer scores every query head against every key in fp32, then their ReLU
        scores += 4 * tokens * tokens * (2 * (d.indexer_heads or m.decode.indexer_heads) + 1)
    return weight_bytes(m), layer + cache + scores + 4 * m.decode.vocab_size


def _plane_bytes(pool, heads: int, layers: int, tokens: int) -> int:
    """``heads`` heads of ``layers`` layers of a bf16 pool's planes (``pool``: the model's bf16 form) for a request of
    ``tokens`` tokens."""
    return sum(pool.comp_row_bytes()) * heads * layers * pool.held_tokens(tokens)


def planes_bytes(model, tokens: int) -> int:
    """One request's whole cache as the model's bf16 pool planes (kvlab.rank.hf_models.pool_rows)."""
    return sum(_plane_bytes(p, p.heads, len(p.layers), tokens) for p in model.pools("bf16"))


def check_bytes(setup: Setup, state: CacheState, dp: int, tokens: int, share: int) -> int:
    """What check=decode keeps on a gen rank (``state``) of DP group ``dp`` through the transfer loop
    (kvlab.rank.decode_check): the layers and heads it holds of each of its group's requests' reference planes,
    in bf16, from before the clock, and the ``share`` bytes it received of each, until the loop ends."""
    if not setup.check.decode or state.side.name != "gen":
        return 0
    bf16 = {p.name: p for p in setup.model.pools("bf16")}
    planes = sum(_plane_bytes(bf16[p.name], len(p.heads), len(p.layers), tokens) for p in state.pools())
    return len(range(dp, setup.workload.requests, setup.gen.dp)) * (planes + share)


def _memory_of(setup: Setup, world_rank: int, gpus: int) -> str:
    if not gpus:
        return "host"
    from kvlab.config.devices import gpu_index

    world = setup.world_size
    return f"cuda:{gpu_index(setup, world_rank, world_rank, world, gpus)}"


def estimate(setup: Setup, gpus: int = 0) -> Budget:
    """Upper bounds of what every rank holds (``gpus``: devices the ranks of this host share; 0: CPU)."""
    t, w = setup.transfer, setup.workload
    longest = w.longest_prompt()
    tokens = longest[2]
    open_requests = min(w.requests, w.concurrency + t.slots)
    # one request of the longest prompt, to DP group 0 of each side: a request to other groups is the same plan with
    # its ranks offset by whole groups (kvlab.model.plan), so a rank needs what its place in group 0 needs
    sample = plan(setup.model, setup.ctx, setup.gen, Request(0, tokens, 0, 0))

    cap = setup.chunk_cap  # None: a pulling transport's chunks are not cut by size
    pulls = setup.transport.cls().pulls

    def chunks(segs) -> int:  # kvlab.model.schedule cuts a segment into cap-sized pieces (per layer for layerwise)
        if t.strategy.cut == Cut.segment:
            return len(segs)
        if cap is None:
            return sum(s.rect.l1 - s.rect.l0 if t.strategy.cut == Cut.layer else 1 for s in segs)
        return sum(math.ceil(s.nbytes / cap) + (s.rect.l1 - s.rect.l0) for s in segs)

    per_request = chunks(sample)
    plan_bytes = w.requests * (per_request * CHUNK_BYTES + REQUEST_BYTES)
    capacity = setup.cache.capacity_tokens
    weights, activations = model_bytes(setup, tokens)
    by_rank: dict[tuple[str, int], list] = {}  # the segments each rank of group 0 sends or receives
    for seg in sample:
        by_rank.setdefault(("ctx", seg.src), []).append(seg)
        by_rank.setdefault(("gen", seg.dst), []).append(seg)
    ranks = []
    for wr in range(setup.world_size):
        side, r = setup.side_of(wr)
        state = CacheState(setup.model, side, r)
        mine = by_rank.get((side.name, r % side.group), [])
        cache = tables = 0
        for pool in state.pools():
            per_req = pool.held_blocks(tokens)  # a context-parallel rank's share of the prompt
            blocks = math.ceil(capacity / pool.tokens_per_block) if capacity and not pool.spec.per_request \
                else open_requests * per_req
            cache += pool.pool_bytes(blocks + setup.cache.spare_blocks)
            tables += open_requests * per_req * 8 * 2  # int64 ids on the device, and their host copy
        biggest = max((s.nbytes for s in mine), default=0)
        if t.strategy.cut != Cut.segment and cap is not None:
            biggest = min(biggest, cap)
        held = sum(s.nbytes for s in mine)
        # naive: a buffer per chunk in flight, at most the slots, and at most the segments of the open requests
        in_flight = min(t.slots, open_requests * len(mine)) \
            if t.strategy.cut == Cut.segment else t.slots
        staging = in_flight * biggest if t.strategy.staging == Staging.per_chunk else t.slots * t.slot_bytes
        if pulls:  # the gen rank copies straight out of the mapped ctx pool: no slot, no buffer
            staging = 0
        memory = _memory_of(setup, wr, gpus)
        piece = FILL_PIECE_BYTES if memory == "host" else verify_piece_bytes("cuda")
        temps = FILL_PIECE_FACTOR * min(piece, max(held, cache // max(1, open_requests)))
        check = check_bytes(setup, state, side.coord(r).dp, tokens, held)
        ranks.append(RankNeed(wr, f"{side.name}{r}", memory, cache, staging, tables, temps, plan_bytes,
                              transport=NCCL_BYTES if memory != "host" else 0, model=weights + activations,
                              check=check))
    return Budget(ranks, open_requests, longest, per_request)


def host_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes (what the kernel can give without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def usable(available: int) -> int:
    return max(0, available - max(MARGIN_MIN, int(MARGIN_SHARE * available)))


def fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _culprit(setup: Setup, b: Budget, part: str, fraction: float) -> tuple[str, object, str]:
    """(field, value, what fits) for the part that makes the run too large, its share ``fraction`` of
    what it needs being all that is left for it."""
    t = setup.transfer
    name, value, tokens = b.longest
    if part == "model":
        m = setup.model
        name = m.name.removesuffix("-model")
        layers = int(m.num_layers * fraction)
        if layers == 0:
            return "model", name, (f"prefill=model cannot hold even one layer of {name} beside the pools; use a "
                                     "smaller model, shorter prompts or a device with more memory")
        return "model.run_layers", m.run_layers or m.num_layers, \
            f"prefill=model fits {layers} of the model's {m.num_layers} layers beside the pools: model.run_layers=" \
            f"{layers}"
    if part == "plan":
        n = int(setup.workload.requests * fraction)
        return "workload.requests", setup.workload.requests, f"at most {n} requests fit ({b.chunks_per_request} " \
                                                          "chunks each at the longest prompt)"
    if part == "staging" and t.strategy.staging == Staging.per_chunk:
        return name, value, f"the naive buffers grow with the prompt: prompts of at most {int(tokens * fraction)} " \
                            "tokens fit, or use transfer=chunked"
    if part == "staging":
        slots, mib = t.slots, t.slot_bytes / 2**20
        if slots / 4 >= mib / 16:  # the knob furthest above its default
            return "transfer.slots", slots, f"transfer.slots <= {max(0, int(slots * fraction))} fits"
        return "transfer.slot_mib", mib, f"transfer.slot_mib <= {mib * fraction:.4g} fits"
    for side in (setup.ctx, setup.gen):  # the cache
        if side.tokens_per_block > max(tokens, 1) * 2:  # blocks far larger than any prompt: mostly padding
            return f"{side.name}.tokens_per_block", side.tokens_per_block, \
                f"a block of {side.tokens_per_block} tokens is larger than any prompt ({tokens}); " \
                f"{side.name}.tokens_per_block <= {max(1, int(side.tokens_per_block * fraction))} fits"
    cap = setup.cache.capacity_tokens
    if cap:
        return "cache.capacity_tokens", cap, f"cache.capacity_tokens <= {int(cap * fraction)} fits"
    n = b.open_requests
    return name, value, f"prompts of at most {int(tokens * fraction)} tokens fit, with {n} request" \
                        f"{'s' if n != 1 else ''} open per rank (fewer with a lower workload.concurrency)"


def _ranks_culprit(setup: Setup, ranks: int, each: float, have: int) -> tuple[str, object, str]:
    """(field, value, what fits) when the ranks are too many for the memory even with empty caches: the
    parallel size that makes the most of them, and how many ranks fit (``each``: a rank's bytes apart from
    what grows with the sizes)."""
    sides = sorted((getattr(side, dim), f"{side.name}.{dim}") for side in (setup.ctx, setup.gen)
                   for dim in SideSpec.RANK_DIMS)
    value, f = sides[-1]
    return f, value, f"{ranks} processes cannot run here: each needs {fmt(int(each))} whatever the sizes, so at " \
                     f"most {int(have // each)} fit (ctx and gen ranks together); lower {f}"


def check(setup: Setup, b: Budget) -> None:
    """ConfigError for the first memory whose ranks need more than it can give (``b.available``)."""
    for memory, have in sorted(b.available.items()):
        need = b.need(memory)
        total = sum(need.values())
        if total <= have:
            continue
        sizable = {k: v for k, v in need.items() if k in ("cache", "staging", "plan", "model")}
        part = max(sizable, key=sizable.get)
        if need.get("model") and total - need["model"] <= have:  # the pools fit: the model takes what is left
            part = "model"
        # what grows with the culprit's field: block tables with the cache, and the naive buffers with the prompt
        scales = {"cache": ("cache", "tables"), "staging": ("staging",), "plan": ("plan",), "model": ("model",)}[part]
        if setup.transfer.strategy.staging == Staging.per_chunk and part in ("cache", "staging"):
            scales = ("cache", "tables", "staging")
        grows = sum(need.get(k, 0) for k in scales)
        fraction = max(0.0, (have - (total - grows)) / grows) if grows else 0.0
        where = [r.name for r in b.ranks if r.on(memory)]
        f, value, fits = _culprit(setup, b, part, fraction)
        if fraction == 0.0 and len(where) > 2:  # what every rank holds whatever the sizes is already too much
            f, value, fits = _ranks_culprit(setup, len(where), (total - grows) / len(where), have)
        shown = ", ".join(f"{k} {fmt(v)}" for k, v in sorted(need.items(), key=lambda kv: -kv[1]) if v)
        src = "MemAvailable less a margin" if memory == "host" else "free memory less a margin"
        raise ConfigError(f, value, f"{' + '.join(where) if len(where) <= 4 else f'{len(where)} ranks'} need "
                          f"{fmt(total)} of {memory} memory ({shown}), {fmt(have)} available ({src}); {fits}")


def measure(setup: Setup) -> Budget:
    """The budget of a run whose ranks all run on this host, with what the host can give. With GPUs the
    device part is left to the ranks themselves (they hold the CUDA contexts that can read it)."""
    from kvlab.config.devices import gpu_count

    b = estimate(setup, gpu_count(setup))
    b.available["host"] = usable(host_available())
    return b


def device_problem(setup: Setup, world_rank: int, gpus: int, free: int, local_world: int) -> tuple | None:
    """On a rank's GPU (``free`` bytes free, read by the rank): (field, value, hint) of the ConfigError
    to raise if the ranks that share it need more, else None. Ranks of other hosts (torchrun across
    nodes) are not counted as sharing it."""
    b = estimate(setup, gpus)
    memory = b.ranks[world_rank].memory
    if local_world != setup.world_size:  # only this host's ranks share its GPUs; which ones is not known here
        b.ranks = [b.ranks[world_rank]]
    b.available = {memory: usable(free)}
    try:
        check(setup, b)
    except ConfigError as e:
        return e.field, e.value, e.hint
    return None


def check_files(setup: Setup, b: Budget) -> None:
    """ConfigError where the transport keeps the ctx pools as files (ipc on CPUs: /dev/shm) and that place cannot
    be written or has no room for them: a pool that does not fit there dies of SIGBUS at its first write."""
    where = setup.transport.cls().pool_files(setup)
    if where is None:
        return
    name = f"transport={setup.transport.name}"
    if os.statvfs(where).f_flag & os.ST_RDONLY or not os.access(where, os.W_OK):
        raise ConfigError("transport", setup.transport.name, f"{name} keeps the ctx pools in {where}, which "
                          "cannot be written here; use transport=p2p")
    need, free = sum(r.cache for r in b.ranks if r.name.startswith("ctx")), shutil.disk_usage(where).free
    if need > free:
        f, value, fits = _culprit(setup, b, "cache", free / need)
        raise ConfigError(f, value, f"{name} keeps the ctx pools in {where}: they need {fmt(need)}, "
                          f"{fmt(free)} free there; {fits}, or use transport=p2p")


def run_dir_bytes(setup: Setup) -> int:
    """An upper bound of the bytes a run writes into its run directory."""
    w, layers = setup.workload, setup.model.num_layers
    n = len(w.timed_trace()) if w.arrival == "trace" else w.requests
    per_request = RESULT_ROW_BYTES + setup.world_size * (PART_ROW_BYTES + layers * PART_LAYER_BYTES) + \
        layers * TIMELINE_ROW_BYTES
    return RUN_DIR_FIXED_BYTES + n * per_request


def check_run_dir(setup: Setup, run_dir, field: str = "hydra.run.dir") -> None:
    """ConfigError where the run directory's file system has less room than the run will write there: a write
    that fails mid-run leaves half a record and a traceback in every rank."""
    need, free = run_dir_bytes(setup), shutil.disk_usage(run_dir).free
    if need > free:
        fits = int((free - RUN_DIR_FIXED_BYTES) / (need - RUN_DIR_FIXED_BYTES) * setup.workload.requests)
        fewer = f", or lower workload.requests (at most {fits} fit)" if fits > 0 else ""
        raise ConfigError(field, run_dir, f"the run writes up to {fmt(need)} there ({setup.workload.requests} "
                          f"requests), {fmt(free)} free; {room_fix(field)}{fewer}")


def check_plan(setup: Setup, b: Budget) -> None:
    """ConfigError for a request count whose planning alone would keep every rank busy for minutes."""
    w = setup.workload
    n = len(w.timed_trace()) if w.arrival == "trace" else w.requests
    each = PLAN_S_PER_REQUEST + b.chunks_per_request * PLAN_S_PER_CHUNK
    if n * each > PLAN_MAX_S:
        raise ConfigError("workload.requests", w.requests, f"planning {n} requests (up to {b.chunks_per_request} "
                          f"chunks each) would take about {n * each / 60:.0f} min in every rank before the first "
                          f"transfer; at most {int(PLAN_MAX_S / each)} plan within {PLAN_MAX_S:g} s: lower "
                          "workload.requests")


def check_host(setup: Setup) -> Budget:
    b = measure(setup)
    check(setup, b)
    check_plan(setup, b)
    check_files(setup, b)
    return b
