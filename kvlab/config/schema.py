"""One config layer: the typed, validated specs of every group, and Hydra's schema derived from them.

Each group has one frozen dataclass (``ModelSpec``, ``SideSpec``, ``TransferSpec``,
``WorkloadSpec``, ``PrefillSpec``, ``CacheSpec``, ``FaultSpec``, ``LoggerSpec``, ``CostSpec``) whose fields,
defaults and ``__post_init__`` checks are the group's only definition. Hydra needs mutable
dataclasses (OmegaConf 2.3 makes a frozen one a read-only node, and overrides then fail to
merge), so ``schema`` derives a mutable twin of each spec for the ConfigStore: a misspelt
key or a value of the wrong type still fails at composition naming the key. ``build`` turns
a composed config into a ``Setup`` of specs: each group checks itself, ``Setup`` checks what
depends on several groups; the first problem raises ``ConfigError`` with one line naming the
field, the value and what would work, before anything is allocated. Past ``build`` nothing
reads the composed config.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from kvlab.config.groups import check_group_choices
from kvlab.core import paths, traces
from kvlab.core.bounds import bounded, check_tree
from kvlab.core.checks import check_config
from kvlab.core.decode_spec import CheckSpec
from kvlab.core.errors import ConfigError, positive, quiet_user_searchpath, require
from kvlab.core.link_spec import LinkSpec
from kvlab.core.rates import CostSpec
from kvlab.core.serving import ServingSpec
from kvlab.model.parallel import SideSpec
from kvlab.model.prefill import PrefillSpec, check_gpu
from kvlab.model.prefix import BLOCK_TOKENS
from kvlab.model.schedule import make_strategy
from kvlab.model.spec import CacheSpec, FaultSpec, LoggerSpec, ModelSpec, WorkloadSpec
from kvlab.model.state import check_kv_dtypes

CONF_DIR = paths.CONF_DIR
KERNELS = ("auto", "torch", "cuda")
DEVICES = ("auto", "cpu", "cuda")
AUTO_TRANSPORT = "auto"  # the transport group's default, resolved on this machine by auto_transport
AUTO_DEFAULT, AUTO_FALLBACK = "p2p", "ipc"
P2P_CLASS = "kvlab.transports.p2p.P2P"

MAX_TIMEOUT_S = 1e6
DEFAULT_SLOT_MIB = 16.0  # transfer.slot_mib when unset, for a transport that stages


@dataclass(frozen=True)
class TransferSpec:
    # a preset's name, or {_target_: a kvlab.model.schedule.Strategy (sub)class or factory, and its traits};
    # a Strategy once built
    strategy: Any = "chunked"
    # MiB of one staging slot (fractions allowed), and the most a chunk holds. Unset (null): 16 MiB slots for a
    # transport that stages, and no cut by size for a pulling one, which has no slot (Setup.chunk_cap)
    slot_mib: Optional[float] = bounded(None, hi=65536.0, unit="MiB", why="64 GiB a slot")
    slots: int = bounded(4, hi=4096)  # staging slots per rank, allocated once at start
    timeout_s: float = 60.0  # a chunk that does not complete within this fails its request
    # the same as prefill.layer_ms (kept for existing configs)
    layer_compute_ms: float = bounded(0.0, hi=60000.0, unit="ms")
    pack_ctas: int = bounded(16, hi=65535)  # CTAs of the pack/unpack kernels: few, so NCCL keeps its SMs
    baseline: bool = True  # measure the link with raw messages of the run's chunk size first (kvlab.rank.linkrate)
    baseline_repeats: int = bounded(3, hi=10000)  # repeats of that reference: its median and range are reported

    def __post_init__(self):
        object.__setattr__(self, "strategy", make_strategy(self.strategy))
        if self.slot_mib is not None:
            require(self.slot_mib > 0, "transfer.slot_mib", self.slot_mib, "must be > 0 MiB")
            require(self.slot_bytes >= 1, "transfer.slot_mib", self.slot_mib, "a slot must hold at least one byte")
        positive("transfer.slots", self.slots)
        positive("transfer.baseline_repeats", self.baseline_repeats)
        require(self.timeout_s > 0, "transfer.timeout_s", self.timeout_s, "must be > 0 seconds")
        # the backends hold it as a timedelta and in milliseconds: 1e300 s overflowed deep in gloo's setup
        require(self.timeout_s <= MAX_TIMEOUT_S, "transfer.timeout_s", self.timeout_s,
                f"must be at most {MAX_TIMEOUT_S:g} seconds (about 11 days)")
        require(self.layer_compute_ms >= 0, "transfer.layer_compute_ms", self.layer_compute_ms, "must be >= 0")
        positive("transfer.pack_ctas", self.pack_ctas)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one staging slot."""
        return int((DEFAULT_SLOT_MIB if self.slot_mib is None else self.slot_mib) * 2**20)


@dataclass(frozen=True)
class TransportSpec:
    """The ``transport`` group: the class that moves chunks (``_target_``) and its options.

    ``name: auto`` (conf/transport/auto.yaml, the default, and a Setup built without a transport) names no
    class: ``Setup`` resolves it on this machine (``auto_transport``) and ``auto`` then says why it became
    what it is; it stays empty for a transport the user named."""

    name: str = "p2p"
    target: str = "kvlab.transports.p2p.P2P"
    options: dict = field(default_factory=dict)
    auto: str = field(default="", compare=False)  # a note on how it was chosen, not part of what it is

    @classmethod
    def of(cls, node) -> TransportSpec:
        if node is None:
            return cls(AUTO_TRANSPORT, "")
        if isinstance(node, TransportSpec):
            return node
        if not isinstance(node, dict):
            raise ConfigError("transport", node, "choose the group, e.g. transport=p2p or transport=ipc "
                              "(conf/transport/<name>.yaml)")
        d = dict(node)
        target, name = d.pop("_target_", None), d.pop("name", None)
        if name == AUTO_TRANSPORT and not target:
            if d:  # the options belong to a transport; auto has not picked one yet
                key = next(iter(d))
                raise ConfigError(f"transport.{key}", d[key], "transport=auto takes no options; name the transport "
                                  f"they belong to, e.g. transport=nixl transport.{key}=...")
            return cls(AUTO_TRANSPORT, "")
        if not target or not name:
            raise ConfigError("transport", d, "a transport file needs _target_ (the class) and name")
        return cls(str(name), str(target), d)

    def cls(self) -> type:
        """The transport class, imported by name: the config does not depend on any transport."""
        import inspect

        from hydra.utils import get_class

        try:
            out = get_class(self.target)
        except Exception as e:  # noqa: BLE001 - any import failure is the config's fault here
            raise ConfigError("transport._target_", self.target, f"cannot be imported ({type(e).__name__}: {e}); "
                              "use a kvlab.transports.Transport subclass, e.g. kvlab.transports.p2p.P2P") from None
        bases = {f"{c.__module__}.{c.__qualname__}" for c in getattr(out, "__mro__", ())}
        if "kvlab.transports.Transport" not in bases:
            raise ConfigError("transport._target_", self.target, "must name a kvlab.transports.Transport subclass")
        takes = list(inspect.signature(out.__init__).parameters)[6:]  # after self, setup, side, ranks, device
        for key, value in self.options.items():
            if key not in takes:
                raise ConfigError(f"transport.{key}", value, f"transport={self.name} has no such option"
                                  + (f"; it takes {', '.join(takes)}" if takes else ""))
        return out


@dataclass(frozen=True)
class Setup:
    """Everything a run is: one spec per group, checked together."""

    model: ModelSpec
    ctx: SideSpec = field(default_factory=lambda: SideSpec("ctx"))
    gen: SideSpec = field(default_factory=lambda: SideSpec("gen"))
    transfer: TransferSpec = field(default_factory=TransferSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    prefill: PrefillSpec = field(default_factory=PrefillSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    fault: FaultSpec = field(default_factory=FaultSpec)
    logger: LoggerSpec = field(default_factory=LoggerSpec)
    cost: CostSpec = field(default_factory=CostSpec)
    check: CheckSpec = field(default_factory=CheckSpec)  # what the gen side checks: bytes, or decode from them
    serving: ServingSpec = field(default_factory=ServingSpec)  # SLOs and percentiles of the serving report
    link: LinkSpec = field(default_factory=LinkSpec)  # kvlab link's message sizes and repeats
    transport: Any = None  # the group's node (conf/transport/; None: auto); a TransportSpec once built
    kernels: str = "auto"  # auto | torch | cuda
    device: str = "auto"  # auto | cpu | cuda
    extra: Any = None  # free-form room for experiments
    # which repeat of the same config this run is, for analysis to take medians and spread over (a sweep axis:
    # kvlab run -m repeat=0,1,2); it changes nothing in the run
    repeat: int = 0

    def __post_init__(self):
        object.__setattr__(self, "model", self.check.model_for(self.model, self.prefill.kind))  # check=decode's model
        for side in ("ctx", "gen"):  # a block size left to the layout, made explicit for this model
            object.__setattr__(self, side, getattr(self, side).resolved(self.model))
        model, ctx, gen = self.model, self.ctx, self.gen
        ctx.validate_for(model)
        gen.validate_for(model)
        if ctx.dtype != gen.dtype:
            raise ConfigError("gen.dtype", gen.dtype,
                              f"must equal ctx.dtype={ctx.dtype}: kvlab moves cache bytes as they are")
        # the chunk cap follows from the transport
        transport = TransportSpec.of(self.transport)
        if transport.name == AUTO_TRANSPORT:
            transport = auto_transport(self)
        object.__setattr__(self, "transport", transport)
        check_kv_dtypes(ctx, gen)
        if ctx.fmt != gen.fmt:
            # a KV dtype converted in flight needs a pack or an unpack (or a pulling copy) to convert in
            require(transport.options.get("mode") != "direct", "transport.mode", "direct",
                    f"writes pool to pool with no pack or unpack to convert ctx.kv_dtype={ctx.kv_dtype or ctx.dtype} "
                    f"into gen.kv_dtype={gen.kv_dtype or gen.dtype} in; use transport.mode=staged or transport=ipc, "
                    "or one kv_dtype on both sides")
        # the smallest chunk is one token row: one token of one layer of a segment's heads
        for pool, row in self.token_rows() if self.chunk_cap is not None else ():
            require(self.chunk_cap >= row, "transfer.slot_mib", self.transfer.slot_mib,
                    f"a slot must hold one token row of pool {pool} ({row} B); use >= {row / 2**20:.6f}")
        # kvlab link moves messages as the run moves chunks: none smaller than the smallest chunk a run has
        row = max(r for _, r in self.token_rows())
        for name in ("min_bytes", "max_bytes"):
            value = getattr(self.link, name)
            require(value is None or value >= row, f"link.{name}", value,
                    f"a message is at least one chunk, one token row of this model ({row} B); use >= {row}")
        cap = self.cache.capacity_tokens
        if self.workload.arrival == "trace":
            self.workload.timed_trace(cap)  # a prompt above the cache is clipped, or refused naming its line
        if cap:
            name, value, longest = self.workload.longest_prompt(cap)
            require(longest <= cap, name, value,
                    f"a {longest}-token prompt does not fit cache.capacity_tokens={cap}; keep prompts at or below "
                    f"{cap} tokens or raise cache.capacity_tokens to >= {longest} (0 sizes the cache to the "
                    "workload)")
        if gen.prefix_cache_tokens:
            self._check_prefix_cache()
        require(self.kernels in KERNELS, "kernels", self.kernels, "use auto, torch or cuda")
        require(isinstance(self.repeat, int) and self.repeat >= 0, "repeat", self.repeat,
                "must be a repeat index >= 0; sweep it for repeats: kvlab run -m repeat=0,1,2")
        require(self.device in DEVICES, "device", self.device, "use auto, cpu or cuda")
        _check_device(self.kernels, self.device)
        for name, r in self.fault.ranks.items():
            require(r < self.world_size, f"fault.{name}_rank", r,
                    f"must be -1 (off) or a world rank in [0, {self.world_size})")
        require(self.fault.unwritten_layer < model.num_layers, "fault.unwritten_layer", self.fault.unwritten_layer,
                f"must be -1 (off) or a layer in [0, {model.num_layers})")
        # transfer.layer_compute_ms, the fixed per-layer time of earlier versions, is prefill.layer_ms now
        if self.transfer.layer_compute_ms and not self.prefill.layer_ms:
            object.__setattr__(self, "prefill", dataclasses.replace(self.prefill,
                                                                    layer_ms=self.transfer.layer_compute_ms))
        if self.prefill.kind == "gpu" or not self.prefill.layer_ms:
            model.dims.validate_for(model)
        check_gpu(self.prefill)
        require(self.prefill.kind != "gpu" or self.device != "cpu", "device", self.device,
                "prefill=gpu computes on the ctx ranks' GPUs; use device=cuda (or auto), or prefill=sim")
        self.check.validate(self)
        if self.prefill.kind == "model" and self.check.decode and not visible_gpus(self.device):
            from kvlab.model.hf_config import check_on_cpu

            check_on_cpu(self.model)
        self.transport.cls().check(self)  # what only the chosen transport knows it cannot serve

    def token_rows(self) -> list[tuple[str, int]]:
        """(pool, bytes) of each pool's one-token row as a segment of this layout carries it: the smallest chunk."""
        out = []
        for pool in self.model.pools(self.ctx.dtype):
            seg_heads = max(1, pool.heads // max(self.ctx.head_tp, self.gen.head_tp)) if not pool.replicated else 1
            out.append((pool.name, pool.token_bytes(min(pool.heads, seg_heads))))
        return out

    def _check_prefix_cache(self) -> None:
        """Prefix reuse needs the blocks of every prompt named (a Mooncake trace's hash_ids, kvlab.model.prefix)."""
        field, tokens, w = "gen.prefix_cache_tokens", self.gen.prefix_cache_tokens, self.workload
        where = f"workload.trace={w.trace}" if w.arrival == "trace" else f"workload.arrival={w.arrival}"
        rows = traces.read(w.trace)[:w.requests] if w.arrival == "trace" else ()
        missing = next((r for r in rows if r.hash_ids is None), None)
        if missing is not None or not rows:
            raise ConfigError(field, tokens, "needs requests that name their prompt blocks (a Mooncake trace's "
                              f"hash_ids: workload=mooncake); {where} has none"
                              f"{f' (line {missing.line})' if missing else ''}; or use 0 (off)")
        for r, (_, isl) in zip(rows, w.timed_trace(self.cache.capacity_tokens)):
            require(len(r.hash_ids) * BLOCK_TOKENS >= isl, "workload.trace", w.trace,
                    f"line {r.line}: {len(r.hash_ids)} hash_ids name {len(r.hash_ids) * BLOCK_TOKENS} tokens, "
                    f"fewer than its {isl}-token prompt (one id per {BLOCK_TOKENS} tokens)")
        require(not self.check.decode, field, tokens,
                "with check=decode the decode model draws each request's prompt apart, so equal prefixes do not "
                "have equal caches; use check=bytes, or 0 (off)")

    @property
    def world_size(self) -> int:
        return self.ctx.size + self.gen.size

    @property
    def chunk_cap(self) -> int | None:
        """The most bytes of one chunk for this run's transport (None: not cut by size); the plan, the
        schedule, the cost model, the memory budget and ``kvlab plan`` all take it from here.

        A transport that stages cuts chunks to its slot (``transfer.slot_bytes``). A pulling transport
        (``Transport.pulls``: the gen rank copies straight out of the mapped ctx pool) has no slot: each
        chunk costs it a readiness wait and a copy launch whatever its size, so by default a chunk is
        what the strategy's readiness allows, one per (request, ctx rank, gen rank, pool) segment, or per
        ready layer of it for a layer-wise cut. A ``transfer.slot_mib`` the user set caps it still."""
        if self.transfer.slot_mib is None and self.transport.cls().pulls:
            return None
        return self.transfer.slot_bytes

    def gpu_index(self, world_rank: int, local_rank: int, local_world: int, n_gpus: int) -> int:
        """The GPU of a rank. With a GPU per local rank: its own. With fewer GPUs than ranks on one host:
        ctx ranks share the first half of the GPUs and gen ranks the second, so that every ctx/gen pair
        group spans two GPUs (NCCL refuses a communicator with two ranks on one GPU)."""
        if n_gpus >= local_world or n_gpus < 2 or local_world != self.world_size:
            return local_rank % n_gpus
        side, rank = self.side_of(world_rank)
        half = n_gpus // 2
        return rank % half if side.name == "ctx" else half + rank % (n_gpus - half)

    def shared_gpu(self, gpus: int, local_world: int) -> tuple[int, int, int] | None:
        """(ctx rank, gen rank, GPU) of the first ctx/gen pair that ``gpu_index`` puts on one GPU of one
        host, or None. Hosts hold consecutive world ranks, ``local_world`` each, as torchrun numbers them."""
        if gpus <= 0:
            return None
        where = [(w // local_world, self.gpu_index(w, w % local_world, local_world, gpus))
                 for w in range(self.world_size)]
        for c in range(self.ctx.size):
            for g in range(self.gen.size):
                if where[c] == where[self.ctx.size + g]:
                    return c, g, where[c][1]
        return None

    def p2p_problem(self, gpus: int, local_world: int) -> str | None:
        """Why p2p's NCCL pair groups cannot be placed on ``gpus`` GPUs per host, or None."""
        clash = self.shared_gpu(gpus, local_world)
        if clash is None:
            return None
        c, g, gpu = clash
        # a GPU per local rank always places them
        need = next(n for n in range(gpus + 1, local_world + 1) if self.shared_gpu(n, local_world) is None)
        return (f"{gpus} GPU{'s' if gpus != 1 else ''} visible for {local_world} ranks on this host, and NCCL "
                f"refuses two ranks of one pair group on one GPU: ctx{c} and gen{g} would share cuda:{gpu} (p2p "
                f"needs at least {need} GPUs here)")

    def side_of(self, world_rank: int) -> tuple[SideSpec, int]:
        """(side, side-local rank) of a world rank: ctx ranks first, then gen ranks."""
        if world_rank < self.ctx.size:
            return self.ctx, world_rank
        return self.gen, world_rank - self.ctx.size

    def world_rank(self, side: str, rank: int) -> int:
        return rank if side == "ctx" else self.ctx.size + rank

    def check_installed(self) -> None:
        """ConfigError naming the extra to install when the transport's package is missing (or cannot serve this
        setup as installed). Only where bytes move (kvlab run, kvlab link, a rank): planning, simulating and
        ``--help`` need no transport package."""
        self.transport.cls().installed(self)

    @property
    def needs_preflight(self) -> bool:
        """Whether kvlab.sizing.preflight.preflight can fail for this setup (it plans every request: skipped when
        not)."""
        return bool(self.cache.capacity_tokens) or self.fault.active

    def to_dict(self) -> dict:
        """Plain values (enums as strings) in the config's shape: what a logger records, and what ``build``
        turns back into this Setup (objects a config names by ``_target_`` keep their target)."""
        def plain(v):
            if isinstance(v, TransportSpec):
                return {"_target_": v.target, "name": v.name, **plain(v.options)}
            if dataclasses.is_dataclass(v):
                out = {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)
                       if f.name != _FROM_KEY.get(type(v))}
                if type(v) not in _SCHEMAS:  # not a group: built from a _target_ (a strategy)
                    out = {"_target_": f"{type(v).__module__}.{type(v).__qualname__}", **out}
                return out
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            return v.value if isinstance(v, Enum) else v

        return plain(self)


def _check_device(kernels: str, device: str) -> None:
    if kernels != "cuda" and device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        if kernels == "cuda":
            raise ConfigError("kernels", kernels, "no CUDA device is visible here; use kernels=torch (or auto)")
        raise ConfigError("device", device, "no CUDA device is visible here; use device=cpu (or auto)")
    require(not (kernels == "cuda" and device == "cpu"), "kernels", kernels,
            "the CUDA kernels need the cache on the GPU; use device=cuda (or auto), or kernels=torch")


def visible_gpus(device: str) -> int:
    """GPUs the ranks of this host share under ``device``; 0 when they run on CPUs."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_world_size(setup: Setup) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else all of them (the local launcher)."""
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", setup.world_size))


def auto_transport(setup: Setup) -> TransportSpec:
    """What ``transport=auto`` is on this machine: p2p, or ipc on one node whose GPUs cannot hold p2p's
    pair groups (one GPU: ipc maps pools instead, with any number of ranks on a GPU). The spec's ``auto``
    says why, in one line."""
    def load(name: str, why: str) -> TransportSpec:
        node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "transport" / f"{name}.yaml"))
        return dataclasses.replace(TransportSpec.of(node), auto=f"transport=auto is {name}{why}")

    gpus, local_world = visible_gpus(setup.device), local_world_size(setup)
    if not gpus:
        return load(AUTO_DEFAULT, ": the ranks run on CPUs (gloo)")
    problem = setup.p2p_problem(gpus, local_world)
    if problem is None:
        return load(AUTO_DEFAULT, f": every ctx/gen pair has its two ranks on different GPUs ({gpus} visible)")
    if local_world != setup.world_size:  # ipc maps memory within one node; kvlab.config.devices refuses p2p here
        return load(AUTO_DEFAULT, ": the ranks span several nodes")
    return load(AUTO_FALLBACK, f", not {AUTO_DEFAULT}: {problem}")


# ---------------------------------------------------------------- Hydra's schema, derived from the specs

# a spec field that the schema leaves out, filled from the key the group sits under (ctx, gen)
_FROM_KEY = {SideSpec: "name"}
_SCHEMAS: dict[type, type] = {}


def _schema_type(tp):
    """The OmegaConf 2.3 spelling of a spec field's type: tuples are lists, specs their schemas."""
    args = typing.get_args(tp)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return Optional[_schema_type(inner)]
    if typing.get_origin(tp) is tuple:
        return List[args[0]]
    if dataclasses.is_dataclass(tp):
        return schema(tp)
    return tp


def schema(spec: type) -> type:
    """The mutable dataclass Hydra composes for ``spec``: the same fields, types and defaults."""
    if spec in _SCHEMAS:
        return _SCHEMAS[spec]
    hints = typing.get_type_hints(spec)
    out = []
    for f in dataclasses.fields(spec):
        if f.name == _FROM_KEY.get(spec):
            continue
        tp = _schema_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            default = field(default_factory=tp) if f.default_factory is not dataclasses.MISSING else MISSING
        elif f.default is not dataclasses.MISSING:
            default = field(default_factory=lambda d=f.default: list(d)) if isinstance(f.default, tuple) else f.default
        else:
            default = MISSING
        out.append((f.name, tp, default if isinstance(default, dataclasses.Field) else field(default=default)))
    name = spec.__name__.replace("Spec", "Cfg") if spec is not Setup else "Config"
    cls = dataclasses.make_dataclass(name, out, namespace={"__doc__": f"Hydra schema of {spec.__name__}",
                                                           "__module__": __name__})
    # a module attribute, so that pickle names it rather than copying it: a launcher that sends the ConfigStore to
    # its jobs (Hydra's submitit launcher) would otherwise give them a copy whose MISSING is no longer MISSING
    globals().setdefault(name, cls)
    _SCHEMAS[spec] = cls
    return cls


def _spec(spec: type, node, key: str | None = None):
    """``spec`` built from a composed node: each nested group first, then the spec's own checks."""
    hints = typing.get_type_hints(spec)
    values = {}
    for f in dataclasses.fields(spec):
        if f.name == _FROM_KEY.get(spec):
            values[f.name] = key
            continue
        if f.name not in node:  # a run directory written before the key existed: the spec's default
            continue
        v = node[f.name]
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            v = _spec(tp, v, f.name)
        elif isinstance(v, (DictConfig, ListConfig)):
            v = OmegaConf.to_container(v, resolve=True)
        if isinstance(v, list) and tuple in (typing.get_origin(tp), *map(typing.get_origin, typing.get_args(tp))):
            v = tuple(v)
        values[f.name] = v
    return spec(**values)


Config = schema(Setup)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base_model", node=schema(ModelSpec))
    cs.store(group="transfer", name="base_transfer", node=schema(TransferSpec))
    cs.store(group="workload", name="base_workload", node=schema(WorkloadSpec))
    cs.store(group="prefill", name="base_prefill", node=schema(PrefillSpec))
    cs.store(group="logger", name="base_logger", node=schema(LoggerSpec))
    cs.store(group="check", name="base_check", node=schema(CheckSpec))


register()


def build(cfg: DictConfig) -> Setup:
    """Validated specs from a composed config; raises ConfigError before anything is allocated."""
    check_config(cfg, Config)  # what no group checks: unknown keys, missing values, numbers that are not finite
    check_tree(Setup, OmegaConf.to_container(cfg, resolve=True))  # every field within its type and bound
    return _spec(Setup, cfg)


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config",
            return_hydra_config: bool = False) -> DictConfig:
    """Compose a config outside of a Hydra app (tests, notebooks, pre-checks); a group chosen by a name that is
    none of its options is a ConfigError naming them, not Hydra's words (kvlab.config.groups)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_group_choices(overrides)
    quiet_user_searchpath()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        cfg = hcompose(config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)
    GlobalHydra.instance().clear()
    return cfg


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
