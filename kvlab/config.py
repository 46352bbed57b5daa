"""Structured configs (Hydra ConfigStore) and their conversion into validated specs.

The dataclasses here are Hydra's schema: a misspelt key or a value of the wrong type
fails at composition naming the key. ``build`` turns a composed config into the typed,
self-validating specs (``ModelSpec``, ``SideSpec``, ``TransferSpec``, ``WorkloadSpec``)
and checks everything that depends on several groups at once; it raises ``ConfigError``
with one line naming the field, the value and what would work, before anything is
allocated.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from kvlab import paths
from kvlab.cost import CostCfg
from kvlab.errors import ConfigError, positive, require
from kvlab.parallel import Layout, SideSpec
from kvlab.schedule import Strategy
from kvlab.spec import Attention, ModelSpec

CONF_DIR = paths.CONF_DIR


@dataclass
class ModelCfg:
    name: str = MISSING
    num_layers: int = MISSING
    attention: Attention = Attention.gqa
    kv_heads: int = 8
    head_dim: int = 128
    mla_dim: int = 576
    indexer: bool = False
    window: int = 0
    local_per_global: int = 0


@dataclass
class SideCfg:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tokens_per_block: int = 32
    layout: Layout = Layout.block_major
    dtype: str = "bf16"
    layer_split: Optional[List[int]] = None


@dataclass
class TransferCfg:
    strategy: Strategy = Strategy.chunked
    slot_mib: float = 16.0  # bytes of one staging slot, in MiB (fractions allowed)
    slots: int = 4  # staging slots per rank, allocated once at start
    timeout_s: float = 60.0  # a chunk that does not complete within this fails its request
    layer_compute_ms: float = 0.0  # simulated prefill compute per layer (layerwise)
    pack_ctas: int = 16  # CTAs of the pack/unpack kernels: few, so NCCL keeps its SMs


@dataclass
class WorkloadCfg:
    isl: int = 4096  # prompt tokens when no list or distribution is given
    requests: int = 4
    concurrency: int = 2  # requests in flight at once
    distribution: str = "fixed"  # fixed | uniform | lognormal
    isl_list: Optional[List[int]] = None  # explicit prompt lengths, cycled
    isl_min: int = 128
    isl_max: int = 131072
    seed: int = 0


@dataclass
class CacheCfg:
    fragmentation: float = 0.0  # share of block allocations taken from a shuffled free list
    spare_blocks: int = 8  # canary blocks per pool beyond what the workload needs
    capacity_tokens: int = 0  # tokens each pool of a rank holds; 0: sized to the workload's worst moment


@dataclass
class FaultCfg:
    """Faults injected on purpose, to test that failures end cleanly and corruption is caught.

    Chunk indices count the chunks one rank takes part in, in its own order (from 0). Byte
    offsets in ``flip_at`` count everything ``flip_rank`` sends (a ctx rank: flipped after pack,
    before the send) or receives (a gen rank: flipped in the receive buffer, before unpack), its
    messages laid end to end in its chunk order.
    """

    kill_rank: int = -1  # world rank that dies (exit code 3) just before posting chunk kill_at_chunk
    kill_at_chunk: int = -1
    stall_rank: int = -1  # world rank that sleeps stall_s just before posting chunk stall_at_chunk
    stall_at_chunk: int = -1
    stall_s: float = 0.0
    flip_rank: int = -1  # world rank whose messages get bytes inverted (x ^ 0xFF) in flight
    flip_at: list[int] = field(default_factory=list)


@dataclass
class WandbCfg:
    mode: str = "offline"  # online | offline | disabled
    project: str = "kvlab"
    group: Optional[str] = None


@dataclass
class LoggerCfg:
    wandb: WandbCfg = field(default_factory=WandbCfg)
    progress: bool = True


@dataclass
class Config:
    model: ModelCfg = MISSING
    ctx: SideCfg = field(default_factory=SideCfg)
    gen: SideCfg = field(default_factory=SideCfg)
    transfer: TransferCfg = field(default_factory=TransferCfg)
    workload: WorkloadCfg = field(default_factory=WorkloadCfg)
    cache: CacheCfg = field(default_factory=CacheCfg)
    fault: FaultCfg = field(default_factory=FaultCfg)
    logger: LoggerCfg = field(default_factory=LoggerCfg)
    cost: CostCfg = field(default_factory=CostCfg)
    kernels: str = "auto"  # auto | torch | cuda
    device: str = "auto"  # auto | cpu | cuda
    extra: Any = None  # free-form room for experiments


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base_model", node=ModelCfg)
    cs.store(group="transfer", name="base_transfer", node=TransferCfg)
    cs.store(group="workload", name="base_workload", node=WorkloadCfg)
    cs.store(group="logger", name="base_logger", node=LoggerCfg)


register()


@dataclass(frozen=True)
class TransferSpec:
    strategy: Strategy
    slot_bytes: int
    slots: int
    timeout_s: float
    layer_compute_ms: float
    pack_ctas: int

    def __post_init__(self):
        require(self.slot_bytes > 0, "transfer.slot_mib", self.slot_bytes / 2**20, "must be at least one byte")
        positive("transfer.slots", self.slots)
        require(self.timeout_s > 0, "transfer.timeout_s", self.timeout_s, "must be > 0 seconds")
        require(self.layer_compute_ms >= 0, "transfer.layer_compute_ms", self.layer_compute_ms, "must be >= 0")
        positive("transfer.pack_ctas", self.pack_ctas)


@dataclass(frozen=True)
class Setup:
    model: ModelSpec
    ctx: SideSpec
    gen: SideSpec
    transfer: TransferSpec
    cfg: DictConfig

    @property
    def world_size(self) -> int:
        return self.ctx.size + self.gen.size

    def side_of(self, world_rank: int) -> tuple[SideSpec, int]:
        """(side, side-local rank) of a world rank: ctx ranks first, then gen ranks."""
        if world_rank < self.ctx.size:
            return self.ctx, world_rank
        return self.gen, world_rank - self.ctx.size

    def world_rank(self, side: str, rank: int) -> int:
        return rank if side == "ctx" else self.ctx.size + rank


def _side(name: str, c) -> SideSpec:
    split = list(c.layer_split) if c.layer_split is not None else None
    return SideSpec(name, c.tp, c.pp, c.dp, c.tokens_per_block, Layout(c.layout), c.dtype,
                    tuple(split) if split is not None else None)


def build(cfg: DictConfig) -> Setup:
    """Validated specs from a composed config; raises ConfigError before anything is allocated."""
    m = cfg.model
    model = ModelSpec(m.name, m.num_layers, Attention(m.attention), m.kv_heads, m.head_dim, m.mla_dim,
                      m.indexer, m.window, m.local_per_global)
    ctx, gen = _side("ctx", cfg.ctx), _side("gen", cfg.gen)
    ctx.validate_for(model)
    gen.validate_for(model)
    if ctx.dtype != gen.dtype:
        raise ConfigError("gen.dtype", gen.dtype,
                          f"must equal ctx.dtype={ctx.dtype}: kvlab moves cache bytes as they are")
    t = cfg.transfer
    require(t.slot_mib > 0, "transfer.slot_mib", t.slot_mib, "must be > 0 MiB")
    require(t.slot_mib * 2**20 >= 1, "transfer.slot_mib", t.slot_mib, "a slot must hold at least one byte")
    transfer = TransferSpec(Strategy(t.strategy), int(t.slot_mib * 2**20), t.slots, float(t.timeout_s),
                            float(t.layer_compute_ms), t.pack_ctas)
    # the smallest chunk is one token row: one token of one layer of a segment's heads
    for pool in model.pools(ctx.dtype):
        seg_heads = max(1, pool.heads // max(ctx.tp, gen.tp)) if not pool.replicated else 1
        row = pool.token_bytes(min(pool.heads, seg_heads))
        require(transfer.slot_bytes >= row, "transfer.slot_mib", t.slot_mib,
                f"a slot must hold one token row of pool {pool.name} ({row} B); use >= {row / 2**20:.6f}")
    w = cfg.workload
    positive("workload.isl", w.isl)
    positive("workload.requests", w.requests)
    positive("workload.concurrency", w.concurrency)
    require(w.distribution in ("fixed", "uniform", "lognormal"), "workload.distribution", w.distribution,
            "use fixed, uniform or lognormal")
    positive("workload.isl_min", w.isl_min)
    require(w.isl_max >= w.isl_min, "workload.isl_max", w.isl_max, f"must be >= workload.isl_min={w.isl_min}")
    if w.isl_list is not None:
        require(len(w.isl_list) > 0 and all(isinstance(x, int) and x > 0 for x in w.isl_list),
                "workload.isl_list", list(w.isl_list), "must be a non-empty list of positive token counts")
    _check_cache(cfg.cache, w)
    require(cfg.kernels in ("auto", "torch", "cuda"), "kernels", cfg.kernels, "use auto, torch or cuda")
    require(cfg.device in ("auto", "cpu", "cuda"), "device", cfg.device, "use auto, cpu or cuda")
    _check_device(cfg.kernels, cfg.device)
    mode = cfg.logger.wandb.mode
    require(mode in ("online", "offline", "shared", "disabled"), "logger.wandb.mode", mode,
            "use online, offline, shared or disabled")
    _check_faults(cfg.get("fault"), ctx.size + gen.size)
    return Setup(model, ctx, gen, transfer, cfg)


def needs_preflight(cfg) -> bool:
    """Whether kvlab.runner.preflight can fail for this config (it plans every request: skipped when not)."""
    f = cfg.get("fault")
    return bool(cfg.cache.capacity_tokens) or (f is not None and max(f.kill_rank, f.stall_rank, f.flip_rank) >= 0)


def longest_prompt(w) -> tuple[str, Any, int]:
    """(field, value, tokens): the longest prompt the workload can produce, and the field that sets it
    (kvlab.workload.prompt_lengths: a list wins, distributions are clipped to isl_max)."""
    if w.isl_list:
        return "workload.isl_list", list(w.isl_list), max(w.isl_list)
    if w.distribution == "fixed":
        return "workload.isl", w.isl, w.isl
    return "workload.isl_max", w.isl_max, w.isl_max


def _check_cache(c, w) -> None:
    require(0.0 <= c.fragmentation <= 1.0, "cache.fragmentation", c.fragmentation, "must be in [0, 1]")
    require(isinstance(c.spare_blocks, int) and c.spare_blocks >= 0, "cache.spare_blocks", c.spare_blocks,
            "must be >= 0 (canary blocks per pool)")
    cap = c.capacity_tokens
    require(isinstance(cap, int) and cap >= 0, "cache.capacity_tokens", cap,
            "must be 0 (sized to the workload) or a positive number of tokens")
    if cap:
        name, value, longest = longest_prompt(w)
        require(longest <= cap, name, value,
                f"a {longest}-token prompt does not fit cache.capacity_tokens={cap}; keep prompts at or below "
                f"{cap} tokens or raise cache.capacity_tokens to >= {longest} (0 sizes the cache to the workload)")


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


def _check_faults(f, world: int) -> None:
    if f is None:
        return
    rank_hint = f"must be -1 (off) or a world rank in [0, {world})"
    for name in ("kill", "stall", "flip"):
        r = f[f"{name}_rank"]
        require(isinstance(r, int) and -1 <= r < world, f"fault.{name}_rank", r, rank_hint)
    for name in ("kill", "stall"):
        on, at = f[f"{name}_rank"] >= 0, f[f"{name}_at_chunk"]
        require(at >= 0 if on else at == -1, f"fault.{name}_at_chunk", at,
                f"set it to the chunk (>= 0) at which fault.{name}_rank acts" if on
                else f"takes effect only with fault.{name}_rank >= 0; set both or neither")
    require(f.stall_s >= 0, "fault.stall_s", f.stall_s, "must be >= 0 seconds")
    require(f.stall_rank < 0 or f.stall_s > 0, "fault.stall_s", f.stall_s,
            "a stall needs a duration > 0 seconds")
    flips = list(f.flip_at)
    require(all(isinstance(x, int) and x >= 0 for x in flips), "fault.flip_at", flips,
            "must be byte offsets >= 0 into the flip rank's stream")
    field_, value = ("fault.flip_at", flips) if f.flip_rank >= 0 else ("fault.flip_rank", f.flip_rank)
    require(bool(flips) == (f.flip_rank >= 0), field_, value,
            "fault.flip_rank and fault.flip_at go together; set both or neither")


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> DictConfig:
    """Compose a config outside of a Hydra app (tests, notebooks, pre-checks)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        cfg = hcompose(config_name, overrides=list(overrides))
    GlobalHydra.instance().clear()
    return cfg


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
