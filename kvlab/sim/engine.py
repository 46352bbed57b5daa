"""The fleet's event loop: prefill queues, transfers contending for links, decode admission and batches.

A plain ``heapq`` event loop (the standard library), not SimPy: what changes a decode group's next
completion is every admission into its batch, which in SimPy means interrupting the group's process
each time; here an event carries the group's version and a stale one is dropped. Work per event is a
few numpy reductions over one request's ranks, and what does not depend on the order of events is
computed for all requests at once beforehand (prefill model times, plan figures per rank and link).

A request's life, each step a measured-style mark as ``kvlab run`` records them:

- arrival; its prefill server (a ctx instance's DP group) is the earliest free one
  (``routing=least_loaded``) or ``i % servers`` (``round_robin``, as kvlab run assigns DP groups);
  first come first served per server, so the prefill timeline is known at arrival;
- ready: the prefill's end, or its first layer's end for a layer-wise strategy (``ready: layer``);
  with ``host_wait`` terms, that share of the time until its server has no prefill left to run;
- admission: the gen DP group with the most free KV tokens that holds the prompt and the output and
  has batch room; without one the request waits, first come first served, for a decode to finish;
- transfer: each of its ctx GPUs and gen GPUs holds its link (``nvlink`` inside a domain, else its
  ``nic``) from the request's start until its own share is through; the start is the latest of
  ready, admission and every one of those links free (a link serves one transfer at a time, in
  admission order), and it ends ``D`` (the busiest link's time) later, plus ``rtt`` and the links'
  latency. With ``L`` layers released one by one (``ready: layer``), the first ``L - 1`` shares are
  taken to pass through the links' gaps while the prefill runs (they do not hold a link) and the last
  share queues for the links once the prefill is done: ``end = max(admitted + D, last + D / L) + rtt``
  with ``last`` when its links are free after the prefill's end;
- decode: the group's batch advances one token per member per step (kvlab.sim.cluster.DecodeSpec),
  integrated between changes of the batch at the step time of the midpoint's cache size.

TTFT = queue + prefill + exposed, where exposed = transfer end - prefill end (admission waits
included), as kvlab run's identity has it; TPOT = decode span / output tokens.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvlab.config.schema import Setup
from kvlab.core.errors import ConfigError
from kvlab.core.sim_terms import PrefillTerms, TransportTerms
from kvlab.model.prefill import layer_seconds
from kvlab.model.schedule import Ready
from kvlab.sim.cluster import ClusterSpec
from kvlab.sim.plans import PlanTable

READY, DONE, DECODED, LAST = 0, 1, 2, 3


@dataclass
class Outcome:
    """Per request (arrays in request order) and for the fleet."""

    arrival: np.ndarray
    isl: np.ndarray
    osl: np.ndarray
    queue: np.ndarray
    prefill: np.ndarray
    admit_wait: np.ndarray  # ready to admitted on a gen group
    transfer: np.ndarray  # transfer start to its end
    exposed: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray  # nan for a request with no output token or without decode
    finish: np.ndarray  # last token (or transfer end without decode)
    bytes: np.ndarray
    link_busy: dict[str, float]  # GPU-seconds each link kind carried bytes
    link_gpus: dict[str, int]  # GPUs with such a link
    prefill_busy: float  # server-seconds prefilling
    decode_busy: float  # group-seconds with a batch
    servers: tuple[int, int]  # prefill servers, decode groups
    events: int
    wall_s: float
    server: np.ndarray  # each request's prefill server
    group: np.ndarray  # its decode group
    admitted: np.ndarray  # when it was admitted on its decode group (its blocks taken)
    transfer_start: np.ndarray
    extra: dict = field(default_factory=dict)


def prefill_model_s(setup: Setup, isls: np.ndarray, tflops: float, mfu: float) -> tuple[np.ndarray, np.ndarray]:
    """(whole prefill, first layer) seconds of each prompt under the prefill group's model on ``tflops`` at ``mfu``
    (exact for up to 256 distinct lengths, else interpolated over 256 geometric ones)."""
    import dataclasses

    spec = dataclasses.replace(setup.prefill, tflops=tflops, mfu=mfu)
    distinct = np.unique(isls)
    pts = distinct if len(distinct) <= 256 else np.unique(np.geomspace(distinct[0], distinct[-1], 256).round())
    whole, first = [], []
    for n in pts:
        s = layer_seconds(setup.model, spec, setup.ctx.tp, int(n), setup.ctx.tokens(0, setup.model))
        whole.append(sum(s))
        first.append(s[0])
    return np.interp(isls, pts, whole), np.interp(isls, pts, first)


def _active_and_weights(setup: Setup, cluster: ClusterSpec) -> tuple[float, float]:
    """(active parameters per token, weight bytes one gen DP group reads per step)."""
    d = cluster.decode
    try:  # active parameters per token, as the prefill's formula counts them (kvlab.model.prefill)
        from kvlab.model.prefill import layer_flops

        active = sum(layer_flops(setup.model, layer, 1) for layer in range(setup.model.num_layers)) / 2
    except Exception:  # noqa: BLE001 - a model without dims: weights_gb must say
        active = 0.0
    return active, d.weights_gb * 1e9 if d.weights_gb is not None else active * d.weight_bytes


def check_decode_memory(setup: Setup, cluster: ClusterSpec) -> None:
    """A gen DP group whose KV capacity comes from its HBM (``cluster.decode.capacity_tokens=0``) must have HBM
    left once the weights are in: said in one line naming the weights' field, before anything is simulated."""
    d, g = cluster.decode, cluster.gpu
    if d.capacity_tokens:
        return
    _, weights = _active_and_weights(setup, cluster)
    hbm = setup.gen.ranks_tp * setup.gen.pp * g.hbm_gb * 1e9 * d.memory_fraction
    if weights >= hbm:
        key, value = (("cluster.decode.weights_gb", d.weights_gb) if d.weights_gb is not None
                      else ("cluster.decode.weight_bytes", d.weight_bytes))
        raise ConfigError(key, value, f"the weights ({weights / 1e9:,.4g} GB) fill a gen DP group's "
                          f"{hbm / 1e9:,.4g} GB (cluster.gpu.hbm_gb x cluster.decode.memory_fraction x its GPUs) and "
                          "leave no room for KV; lower it, give the gen side more GPUs (gen.tp, gen.pp), or set "
                          "cluster.decode.capacity_tokens")


def decode_rates(setup: Setup, cluster: ClusterSpec, kv_token_bytes: float) -> tuple[float, float, float, int]:
    """(seconds per step fixed, per cached token, per batch member) and KV tokens of one gen DP group."""
    g = cluster.gpu
    d = cluster.decode
    gpus = setup.gen.ranks_tp * setup.gen.pp
    active, weights = _active_and_weights(setup, cluster)
    hbm = gpus * g.hbm_gbps * 1e9 * g.hbm_efficiency
    fixed = d.step_us * 1e-6 + weights / hbm
    per_token = kv_token_bytes / hbm
    per_member = 2 * active / (gpus * g.tflops * 1e12 * g.mfu)
    cap = d.capacity_tokens
    if not cap:
        free = gpus * g.hbm_gb * 1e9 * d.memory_fraction - weights
        cap = int(free / kv_token_bytes) if kv_token_bytes and free > 0 else 0
    return fixed, per_token, per_member, cap


def check_decode_capacity(cluster: ClusterSpec, cap: int, kv_token_bytes: float, need) -> None:
    """Every request (``need``: its prompt + output tokens) must fit one gen DP group's KV, ``cap`` tokens
    (``decode_rates``): one line naming the capacity as given (0: worked out from the HBM, said so) and the first
    request that cannot."""
    need = np.asarray(need, dtype=float)
    worst = int(np.argmax(need)) if len(need) else 0
    if len(need) and need[worst] > cap:
        given = cluster.decode.capacity_tokens
        holds = (f"a gen DP group holds {cap:,} KV tokens" if given else
                 f"from its HBM a gen DP group holds {cap:,} KV tokens of {kv_token_bytes:,.0f} bytes each")
        raise ConfigError("cluster.decode.capacity_tokens", given, f"{holds} and request {worst} needs "
                          f"{int(need[worst]):,} (prompt + output); give the gen side more GPUs (gen.tp, gen.pp), "
                          "a larger cluster.gpu.hbm_gb, or cap workload.isl_max")


class DecodeGroup:
    """One gen DP group's batch on a virtual clock: ``v`` tokens per member since the group began."""

    __slots__ = ("v", "t", "b", "c", "heap", "version", "busy", "fixed", "per_token", "per_member")

    def __init__(self, fixed: float, per_token: float, per_member: float):
        self.v = self.t = 0.0
        self.b = 0
        self.c = 0.0  # sum over members of (prompt - v at their start): cached tokens = c + b * v
        self.heap: list[tuple[float, int]] = []
        self.version = 0
        self.busy = 0.0
        self.fixed, self.per_token, self.per_member = fixed, per_token, per_member

    def _span(self, dv: float) -> float:
        k = self.c + self.b * (self.v + dv / 2)
        return dv * (self.fixed + max(self.per_token * k, self.per_member * self.b))

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt <= 0 or not self.b:
            self.t = max(self.t, now)
            return
        # solve dv * (fixed + max(pt * (c + b (v + dv/2)), pm * b)) = dt: each branch's root, the smaller wins
        a1 = self.fixed + self.per_token * (self.c + self.b * self.v)
        q = self.per_token * self.b / 2
        dv1 = (-a1 + math.sqrt(a1 * a1 + 4 * q * dt)) / (2 * q) if q > 0 else dt / a1
        dv2 = dt / (self.fixed + self.per_member * self.b)
        self.v += min(dv1, dv2)
        self.busy += dt
        self.t = now

    def next_finish(self) -> float | None:
        if not self.heap:
            return None
        return self.t + self._span(max(0.0, self.heap[0][0] - self.v))


def simulate(setup: Setup, cluster: ClusterSpec, terms: TransportTerms, prefill_terms: PrefillTerms,
             table: PlanTable, arrival: np.ndarray, isl: np.ndarray, osl: np.ndarray, decode: bool = True,
             links: list | None = None, prefill_s: np.ndarray | None = None,
             after: list[np.ndarray] | None = None) -> Outcome:
    """Run the fleet over the requests (arrays in arrival order). ``links``: ``[ctx instance][gen instance]`` -> whether
    they share an NVLink domain, default ``cluster.same_domain``; ``prefill_s``: each prefill's duration as
    measured, in place of the calibrated model (a replay that isolates the transfer); ``after``: per request, the
    requests whose chunks come before its last one in a kvlab run's global chunk order (kvlab.config.workload):
    every rank
    serves its chunks in that order, so its transfer waits ``order_wait`` of the time until theirs could start."""
    t_wall = time.perf_counter()
    n = len(arrival)
    ctx, gen = setup.ctx, setup.gen
    cg, gg = ctx.group, gen.group  # GPUs of one DP group
    n_p, n_d = cluster.ctx_instances * ctx.dp, cluster.gen_instances * gen.dp

    # -- prefill: FIFO per server, known at arrival
    model_s, first_s = prefill_model_s(setup, isl, cluster.gpu.tflops, cluster.gpu.mfu)
    req_bytes = table.bytes.sum(axis=1)
    pre = terms.prefill_slowdown * (prefill_terms.scale * model_s + req_bytes * prefill_terms.byte_ns * 1e-9
                                     + prefill_terms.fixed_ms * 1e-3)
    if prefill_s is not None:
        pre = np.where(np.isfinite(prefill_s), prefill_s, pre)
    first = np.where(model_s > 0, pre * first_s / np.where(model_s > 0, model_s, 1), pre)
    free = np.zeros(n_p)
    server = np.zeros(n, dtype=np.int64)
    start = np.zeros(n)
    for i in range(n):
        s = int(np.argmin(free)) if cluster.routing == "least_loaded" else i % n_p
        server[i] = s
        start[i] = max(arrival[i], free[s])
        free[s] = start[i] + pre[i]
    end = start + pre
    idle = end.copy()  # when the server next has nothing to prefill: the end of the busy streak
    if terms.host_wait:
        for s in range(n_p):
            ids = np.nonzero(server == s)[0]  # its service order: arrival order
            streak_end = 0.0
            for k in range(len(ids) - 1, -1, -1):
                i = ids[k]
                if k + 1 < len(ids) and start[ids[k + 1]] <= end[i] + 1e-12:
                    idle[i] = streak_end
                else:
                    idle[i] = streak_end = end[i]
    per_layer = setup.transfer.strategy.ready == Ready.layer
    layers = setup.model.num_layers
    ready = np.where(per_layer, start + first, end)
    if after is not None and terms.order_wait:
        ahead = np.array([max(ready[i], ready[a].max(initial=0.0)) for i, a in enumerate(after)])
        ready = ready + terms.order_wait * (ahead - ready)
    ready = ready + terms.host_wait * np.maximum(0.0, idle - ready)

    # -- each request's time per link kind and GPU
    byte_s = terms.byte_ns * 1e-9
    kinds = {}
    for kind in ("nvlink", "nic"):
        link = cluster.links.get(kind)
        if link is None:
            continue
        per_byte = max(byte_s, link.byte_s)
        pair_s = (table.pieces * terms.piece_us * 1e-6 + table.bytes * per_byte
                  + table.staged * terms.staged_byte_ns * 1e-9)
        kinds[kind] = (table.per_src(pair_s, cg * ctx.dp), table.per_dst(pair_s, gg * gen.dp), link.latency_us * 1e-6)
    src_used = np.nonzero(table.per_src(table.bytes[:1] + 1, cg * ctx.dp)[0] > 0)[0]  # ranks of DP group 0
    dst_used = np.nonzero(table.per_dst(table.bytes[:1] + 1, gg * gen.dp)[0] > 0)[0]
    same = links if links is not None else cluster.same_domain(cg * ctx.dp, gg * gen.dp)
    out_free = {k: np.zeros(cluster.ctx_instances * ctx.size) for k in kinds}
    in_free = {k: np.zeros(cluster.gen_instances * gen.size) for k in kinds}
    busy = {k: 0.0 for k in kinds}

    fixed, per_token, per_member, cap = decode_rates(setup, cluster, table.kv_token_bytes)
    groups = [DecodeGroup(fixed, per_token, per_member) for _ in range(n_d)]
    free_tokens = np.full(n_d, float(cap))
    batch = np.zeros(n_d, dtype=np.int64)
    need = isl.astype(float) + osl
    if decode:
        check_decode_capacity(cluster, cap, table.kv_token_bytes, need)

    admitted = np.full(n, np.nan)
    t_start = np.full(n, np.nan)
    t_end = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    group_of = np.zeros(n, dtype=np.int64)
    route: dict[int, tuple] = {}  # request -> (link kind, its ctx GPUs, its gen GPUs)
    waiting: deque[int] = deque()  # admission queue, first come first served
    ev: list[tuple[float, int, int, int, int]] = [(ready[i], i, READY, i, 0) for i in range(n)]
    heapq.heapify(ev)
    seq = n
    events = 0

    def admit(i: int, now: float) -> bool:
        nonlocal seq
        if decode:
            ok = (free_tokens >= need[i]) & (batch < cluster.decode.max_batch)
            if not ok.any():
                return False
            g = int(np.argmax(np.where(ok, free_tokens, -1.0)))
            free_tokens[g] -= need[i]
            batch[g] += 1
        else:
            g = i % n_d
        group_of[i] = g
        admitted[i] = now
        ci, cdp = divmod(int(server[i]), ctx.dp)
        gi, gdp = divmod(g, gen.dp)
        kind = "nvlink" if same[ci][gi] and "nvlink" in kinds else "nic"
        so = ci * ctx.size + cdp * cg + src_used
        do = gi * gen.size + gdp * gg + dst_used
        route[i] = (kind, so, do)
        if per_layer:
            # the first layers' shares trickle through the links' gaps while the prefill runs; the last
            # layer's share queues for the links once the prefill is done, like any transfer
            t_start[i] = now
            seq += 1
            heapq.heappush(ev, (max(now, end[i]), seq, LAST, i, 0))
        else:
            place(i, now, now)
        return True

    def place(i: int, now: float, s_first: float) -> None:
        """Take request ``i``'s links from ``now`` (its last layer's share with ``per_layer``) and schedule its end."""
        nonlocal seq
        kind, so, do = route[i]
        src_t, dst_t, lat = kinds[kind]
        s_t, d_t = src_t[i, src_used], dst_t[i, dst_used]
        of, inf = out_free[kind], in_free[kind]
        s0 = max(now, float(of[so].max(initial=0.0)), float(inf[do].max(initial=0.0)))
        dur = max(float(s_t.max(initial=0.0)), float(d_t.max(initial=0.0)))
        share = 1.0 / layers if per_layer else 1.0
        of[so] = s0 + s_t * share
        inf[do] = s0 + d_t * share
        busy[kind] += float(s_t.sum() + d_t.sum()) / 2
        done = max(s_first + dur, s0 + dur * share) if per_layer else s0 + dur
        done += terms.rtt_us * 1e-6 + 2 * lat
        if not per_layer:
            t_start[i] = s0
        t_end[i] = done
        seq += 1
        heapq.heappush(ev, (done, seq, DONE, i, 0))

    def reschedule(g: int) -> None:
        nonlocal seq
        grp = groups[g]
        grp.version += 1
        t = grp.next_finish()
        if t is not None:
            seq += 1
            heapq.heappush(ev, (t, seq, DECODED, g, grp.version))

    while ev:
        now, _, kind, x, version = heapq.heappop(ev)
        events += 1
        if kind == READY:
            if waiting or not admit(x, now):
                waiting.append(x)
        elif kind == LAST:
            place(x, now, t_start[x])
        elif kind == DONE:
            if not decode:
                finish[x] = now
                continue
            g = int(group_of[x])
            grp = groups[g]
            grp.advance(now)
            if osl[x] <= 0:
                finish[x] = now
                free_tokens[g] += need[x]
                batch[g] -= 1
            else:
                grp.b += 1
                grp.c += isl[x] - grp.v
                heapq.heappush(grp.heap, (grp.v + osl[x], x))
            reschedule(g)
        else:  # DECODED
            grp = groups[x]
            if version != grp.version:
                continue
            grp.advance(now)
            while grp.heap and grp.heap[0][0] <= grp.v + 1e-6:
                _, r = heapq.heappop(grp.heap)
                finish[r] = now
                grp.b -= 1
                grp.c -= isl[r] - (grp.v - osl[r])
                free_tokens[x] += need[r]
                batch[x] -= 1
            if not grp.b:
                grp.c = 0.0
            reschedule(x)
            while waiting and admit(waiting[0], now):
                waiting.popleft()

    if waiting:  # only when decode can never make room: named, not hidden
        raise RuntimeError(f"{len(waiting)} requests were never admitted")
    exposed = t_end - end
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where((osl > 0) & decode, (finish - t_end) / np.maximum(osl, 1), np.nan)
    return Outcome(arrival, isl, osl, start - arrival, pre, admitted - ready, t_end - t_start, exposed,
                   t_end - arrival, tpot, finish, req_bytes, busy,
                   {k: cluster.ctx_instances * ctx.size + cluster.gen_instances * gen.size for k in kinds},
                   float(pre.sum()), float(sum(g.busy for g in groups)), (n_p, n_d), events,
                   time.perf_counter() - t_wall, server, group_of, admitted, t_start, {"kv_tokens_per_group": cap})
