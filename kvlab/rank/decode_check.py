"""``check=decode`` on one rank: the model's own cache is what moves, and the gen side decodes from it.

Before the clock starts (nothing here is on the measured path):
- a ctx rank runs its decode model's prefill (kvlab.rank.hf_models) for each request its DP group
  prefills, and keeps every pool's planes; the prefill thread then writes them where it wrote the
  hash fill, layer by layer as the serving timeline says (``PagedCache.contents``), for the heads
  and layers this rank holds. The first TP rank of the first stage posts the prefill's first
  token to the key-value store, as the prefill instance hands it to the decode instance;
- a gen rank loads (or computes, and keeps on disk: ``reference``) the reference of each request
  its DP group decodes: the same prefill in one process, then ``check.tokens`` greedy tokens. Its
  prefill's planes are what the byte check compares the received bytes with.

A gen rank keeps the layers and heads it holds of its references' planes on its device from before the clock,
and after a request's byte check copies what it holds of it out of its pool (its share) into device memory,
before its blocks are freed (``PagedCache.after_verify``): on a GPU nothing of the check crosses to the host
inside the receive loop, where later requests' transfers would wait for it (``kvlab.sizing.budget`` counts
both). After the transfer loop every gen rank posts its shares to the store, and the first rank of each gen
DP group gathers its group's, rebuilds the model's cache from them, decodes and compares tokens and logits
with the reference. A request that does not decode as the reference fails with one line naming the step, the layers
whose cache differs from the reference's in the tokens decoding reads, and the byte check's verdict
beside it.

The models run on the rank's device, in bf16 on a GPU too, and the reference on the same kind of
device: the gen side's decode then runs the same kernels on the same shapes as the reference, so
that bytes that arrived whole decode to the same logits there as well (``check.tolerance`` admits
a difference where a device's kernels are not deterministic).
"""
from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, replace

import torch

from kvlab.core import decode_spec
from kvlab.core.decode_spec import CACHE_ENV
from kvlab.core.paths import write_whole
from kvlab.memory import fill
from kvlab.model.layout import convert_wire
from kvlab.model.plan import Request
from kvlab.model.spec import Kind
from kvlab.model.tokens import to_global
from kvlab.rank import hf_models, store_pieces
from kvlab.results.records import DecodeResult, RankPart

KEY = "kvlab/decode/"
COMPONENTS = {Kind.kv: ("K", "V"), Kind.mla: ("latent and RoPE",), Kind.indexer: ("fp8 values", "scales"),
              Kind.state: ("conv q/x", "conv k/B", "conv v/C", "recurrent state")}
FORMAT = 2  # of a reference file: bump when what it holds changes


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


cache_dir = decode_spec.cache_dir


@dataclass
class Reference:
    """One request decoded without disaggregation: its prefill's planes (kvlab.rank.hf_models.pool_rows), the
    prefill's greedy token, and the tokens and logits of ``check.tokens`` steps after it."""

    planes: dict[str, list[torch.Tensor]]
    first: int
    tokens: list[int]
    logits: torch.Tensor  # [steps, vocab] fp32


def reference_key(model, check, ids: torch.Tensor) -> str:
    import transformers

    net_cfg = hf_models.hf_config(model).to_json_string(use_diff=False)
    what = {"format": FORMAT, "config": net_cfg, "init_std": hf_models.INIT_STD, "seed": check.seed,
            "tokens": check.tokens, "prompt": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
            "isl": int(ids.shape[1]), "transformers": transformers.__version__, "torch": torch.__version__,
            "pools": [(p.name, p.layers, p.window, p.heads, p.comp_row_bytes()) for p in model.pools("bf16")]}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def reference(model, check, ids: torch.Tensor, use_disk: bool = True, device="cpu") -> Reference:
    """The reference of the prompt ``ids`` computed on ``device``'s kind, from the disk cache when it holds it
    (keyed by the decode model's config, the seed, the prompt, the device kind and the library versions), else
    computed and kept there."""
    kind = torch.device(device).type
    path = cache_dir() / f"{reference_key(model, check, ids)}{'' if kind == 'cpu' else '-' + kind}.pt"
    if use_disk and path.exists():
        try:
            d = torch.load(path, weights_only=True)
            return Reference(d["planes"], d["first"], d["tokens"], d["logits"])
        except Exception:  # noqa: BLE001 - a torn or stale file is recomputed
            pass
    net, cfg = hf_models.build(model, check.seed, str(device))
    isl = int(ids.shape[1])
    cache, last = hf_models.full_prefill(net, cfg, ids)
    planes = hf_models.pool_rows(model, cache)
    first = int(last.argmax())
    hf_models.reference_cache(model, cache, isl)
    tokens, logits = hf_models.decode(net, cache, first, check.tokens)
    ref = Reference(planes, first, tokens, logits)
    if use_disk:
        path.parent.mkdir(parents=True, exist_ok=True)
        # several gen ranks may write it at once: each renames a whole file of its own over it
        write_whole(path, _dumps({"planes": planes, "first": first, "tokens": tokens, "logits": logits}), CACHE_ENV)
    return ref


def compare(tokens: list[int], logits: torch.Tensor, ref: Reference, tolerance: float) -> DecodeResult:
    """Tokens and logits of one decode against the reference's."""
    diff = (logits - ref.logits).abs().amax(-1)  # per step
    bad = [i for i, (t, r, d) in enumerate(zip(tokens, ref.tokens, diff.tolist())) if t != r or not d <= tolerance]
    return DecodeResult(tokens=len(tokens), equal=sum(t == r for t, r in zip(tokens, ref.tokens)),
                        max_logit_diff=float(diff.max()) if diff.numel() else 0.0,
                        first_divergent=bad[0] if bad else None)


class DecodeCheck:
    """One rank's part of check=decode (see the module's docstring); ``store``: the run's key-value store."""

    def __init__(self, setup, side: str, rank: int, requests: list[Request], store):
        self.setup, self.side, self.rank, self.store = setup, side, rank, store
        self.model, self.check = setup.model, setup.check
        spec = setup.ctx if side == "ctx" else setup.gen
        self.coord = spec.coord(rank)
        self.requests = [r for r in requests if (r.ctx_dp if side == "ctx" else r.gen_dp) == self.coord.dp]
        self.group = [g for g in range(spec.size) if spec.coord(g).dp == self.coord.dp]
        self.lead = side == "gen" and rank == self.group[0]
        self.planes: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.refs: dict[int, Reference] = {}
        self.shares: dict[int, dict] = {}  # request -> pool -> (rect, its wire bytes on the rank's device)
        self.byte_ok: dict[int, bool] = {}
        self.cache = None
        # a side keeping the cache in another KV dtype (kvlab.model.kv_dtype): decoding measures what it costs
        self.lossy = bool(setup.ctx.fmt or setup.gen.fmt)

    # -- before the clock -------------------------------------------------------------------
    def prepare(self, cache, beat=lambda: None) -> None:
        """Prefill (ctx) or load the references (gen) of this rank's requests; hook into its cache."""
        for r in self.requests:
            beat()
            if self.side == "ctx" and self.setup.prefill.kind == "model":
                self.planes[r.id] = {}  # filled on the clock, layer by layer (kvlab.rank.prefill_model)
                continue
            ids = hf_models.prompt(self.check, self.model, r.id, r.isl)
            if self.side == "ctx":
                net, cfg = hf_models.build(self.model, self.check.seed, str(cache.device))
                out, last = hf_models.full_prefill(net, cfg, ids)
                self.planes[r.id] = hf_models.pool_rows(self.model, out)
                self.post_first(r.id, int(last.argmax()))
            else:
                ref = reference(self.model, self.check, ids, device=cache.device)
                self.planes[r.id] = self._own(cache, ref.planes)
                if self.lead:
                    self.refs[r.id] = ref
        self.cache = cache
        cache.contents = self.expected
        if self.side == "gen":
            cache.after_verify = self.keep

    @staticmethod
    def _own(cache, planes: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """The layers and heads of ``planes`` that a gen rank holds (its byte check reads no others), on its
        device; ``expected`` shifts a rectangle by where they start."""
        out = {}
        for name, comps in planes.items():
            store = cache.pools.get(name)
            if store is not None:
                ls, hs = store.pool.layers, store.pool.heads
                out[name] = [c[ls.start:ls.stop, hs.start:hs.stop].to(cache.device) for c in comps]
        return out

    def post_first(self, request: int, token: int) -> None:
        """The prefill's greedy token, as the prefill instance hands it to the decode instance (the first TP
        rank of the first stage posts it)."""
        if self.coord.tp == 0 and self.coord.pp == 0:
            self.store.set(f"{KEY}first/{request}", str(token))

    def expected(self, request: int, pool, rect, device="cpu", out: torch.Tensor | None = None) -> torch.Tensor:
        """kvlab.memory.fill.expected's counterpart: the model's bytes of ``rect`` in wire order; the hash fill's
        for a request whose model cache this rank does not hold (fault.reused_block's other request, or one
        prefill=model has not computed yet or has already written)."""
        planes = self.planes.get(request, {}).get(pool.name)
        if planes is None:
            return fill.expected(request, pool, rect, device, out)
        at = rect
        if self.side == "gen":  # ``_own``'s planes start at the rank's first layer and head
            at = replace(rect, l0=rect.l0 - pool.layers.start, l1=rect.l1 - pool.layers.start,
                         h0=rect.h0 - pool.heads.start, h1=rect.h1 - pool.heads.start)
        data = hf_models.wire_bytes(planes, at)
        if pool.spec.fmt:  # a pool in another KV dtype holds the model's values in it (kvlab.model.kv_dtype)
            data = convert_wire(data, rect, replace(pool.spec, fmt=""), pool.spec)
        if out is None:
            return data.to(device)
        out.copy_(data)
        return out

    # -- after each request's byte check (gen) ------------------------------------------------
    def keep(self, req: Request, ops, errors: list[str]) -> None:
        """This rank's share of ``req``: everything its pools hold of it, before its blocks are freed, as wire
        bytes on the rank's device (turned into planes after the transfer loop, ``_planes``). Its reference planes
        are dropped: the byte check was their last reader on the clock."""
        cache, share = self.cache, {}
        self.planes.pop(req.id, None)
        for name, store in cache.pools.items():
            table = cache.tables[req.id][name]
            share[name] = []
            for rect in cache.held_rects(name, req.isl):  # a DCP rank's: its local positions
                buf = torch.empty(rect.nbytes(store.pool.rows), dtype=torch.uint8, device=cache.device)
                ops.pack(store.storage, store.pool, store.num_blocks, rect, table.ids, table.base, buf)
                share[name].append((rect, buf))
        if cache.device.type == "cuda":  # the blocks are freed next, and another stream may write them
            torch.cuda.current_stream(cache.device).synchronize()
        self.shares[req.id] = share
        self.byte_ok[req.id] = not errors

    def _planes(self, request: int) -> dict:
        """``keep``'s wire bytes of ``request`` as pool name -> (rect bounds, local positions, component planes),
        read back as the model's values (dequantized where the pool holds fp8)."""
        out = {}
        for name, pieces in self.shares[request].items():
            out[name] = []
            for rect, buf in pieces:
                spec = self.cache.pools[name].pool.spec
                base = replace(spec, fmt="")
                planes = hf_models.from_wire(convert_wire(buf.cpu(), rect, spec, base), rect, base.comp_row_bytes())
                out[name].append(((rect.l0, rect.l1, rect.h0, rect.h1, rect.t0, rect.t1), rect.local, planes))
        return out

    # -- after the transfer loop (gen) --------------------------------------------------------
    def finish(self, parts: list[RankPart], beat=lambda: None) -> None:
        """Post this rank's shares; the group's first rank decodes each request and records the result in
        its part (a request that does not decode as the reference gets an error line)."""
        if self.side != "gen":
            return
        mine = {}
        for r in self.requests:
            payload = ({"byte_ok": self.byte_ok[r.id], "share": self._planes(r.id)} if r.id in self.shares
                       else {"missing": True})
            mine[r.id] = payload
            if not self.lead:
                store_pieces.put(self.store, f"{KEY}share/{r.id}/{self.rank}", _dumps(payload))
        if not self.lead:
            return
        by_id = {p.request: p for p in parts}
        for r in self.requests:
            beat()
            part = by_id.get(r.id)
            if part is None:
                continue
            result, error = self.decode(r, mine[r.id], beat)
            part.decode = result
            if error:
                part.errors.append(error)

    def _payloads(self, r: Request, own: dict, beat) -> dict[int, dict]:
        out = {self.rank: own}
        for g in self.group:
            if g != self.rank:
                beat()
                out[g] = _loads(store_pieces.get(self.store, f"{KEY}share/{r.id}/{g}", remove=True))
        return out

    def _misplace(self, planes: dict, isl: int) -> None:
        """fault.misplaced_run: the gather puts interleave run N (gen.dcp_interleave tokens, in global order) one
        run late, over run N+1, and leaves run N's place empty, as a DCP rank's shard placed at the wrong offset
        would: every byte arrived right, only the reassembly is wrong. (A swap of two whole runs, K and V of each
        token together, would not do: attention over a full cache does not depend on the order of its tokens.)"""
        n, run = self.setup.fault.misplaced_run, self.setup.gen.dcp_interleave
        if n < 0:
            return
        a, b = n * run, min((n + 1) * run, isl)
        for comps in planes.values():
            for plane in comps:
                plane[:, :, b:b + (b - a)] = plane[:, :, a:b].clone()
                plane[:, :, a:b] = 0

    def decode(self, r: Request, own: dict, beat=lambda: None) -> tuple[DecodeResult | None, str | None]:
        payloads = self._payloads(r, own, beat)
        missing = [g for g, p in payloads.items() if p.get("missing")]
        if missing:
            return None, None  # those ranks failed the request and say why in their parts
        planes = {p.name: [torch.zeros(len(p.layers), p.heads, p.held_tokens(r.isl), row, dtype=torch.uint8)
                           for row in p.comp_row_bytes()] for p in self.model.pools(self.setup.gen.dtype)}
        for p in payloads.values():
            for name, pieces in p["share"].items():
                for (l0, l1, h0, h1, t0, t1), local, comps in pieces:
                    # a DCP rank's shard goes back to its global tokens, in order: its runs interleaved with the
                    # other DCP ranks' (kvlab.model.tokens)
                    at = slice(t0, t1) if local is None else to_global(tuple(local), torch.arange(t0, t1))
                    for c, plane in enumerate(comps):
                        planes[name][c][l0:l1, h0:h1, at] = plane
        self._misplace(planes, r.isl)
        ref = self.refs[r.id]
        first = int(self.store.get(f"{KEY}first/{r.id}"))
        net, cfg = hf_models.build(self.model, self.check.seed, str(self.cache.device))
        tokens, logits = hf_models.decode(net, hf_models.model_cache(self.model, cfg, planes, r.isl,
                                                                     self.cache.device), first, self.check.tokens)
        result = compare(tokens, logits, ref, self.check.tolerance)
        failed_bytes = [f"gen{g}" for g, p in sorted(payloads.items()) if not p["byte_ok"]]
        result.byte_failures = len(failed_bytes)
        diffs = hf_models.cache_differences(self.model, planes, ref.planes, r.isl)
        result.layers = sorted({d["layer"] for d in diffs})
        if first == ref.first and result.first_divergent is None or self.lossy:
            return result, None  # a lossy KV dtype's cost is reported (tokens equal, logit difference), not failed
        what = (f"the prefill's first token {first} is not the reference's {ref.first}" if first != ref.first
                else f"diverges from the reference at step {result.first_divergent}")
        by_layer: dict[tuple, list[dict]] = {}
        for d in diffs:
            by_layer.setdefault((d["layer"], d["pool"]), []).append(d)
        named = []
        for (layer, pool), ds in by_layer.items():
            comps = ", ".join(COMPONENTS[hf_models.pool_spec(self.model, pool).kind][d["component"]] for d in ds)
            named.append(f"layer {layer} ({pool} {comps}: {max(d['tokens'] for d in ds)} token(s) from token "
                         f"{min(d['token'] for d in ds)})")
        where = ("; its cache differs from the reference's in " + ", ".join(named[:4])
                 + (f" and {len(named) - 4} more layers" if len(named) > 4 else "")
                 if named else "; its cache equals the reference's in every token decoding reads")
        verdict = (f"; byte check failed on {', '.join(failed_bytes)}" if failed_bytes
                   else "; byte check passed on every gen rank")
        return result, (f"request {r.id}: decode from the moved cache {what} ({result.equal}/{result.tokens} tokens "
                        f"equal, max |logit difference| {result.max_logit_diff:.4g}){where}{verdict}")
