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
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from kvlab.errors import ConfigError, positive, require
from kvlab.parallel import Layout, SideSpec
from kvlab.schedule import Strategy
from kvlab.spec import Attention, ModelSpec

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


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
    logger: LoggerCfg = field(default_factory=LoggerCfg)
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
        raise ConfigError("gen.dtype", gen.dtype, f"must equal ctx.dtype={ctx.dtype}: kvlab moves cache bytes as they are")
    t = cfg.transfer
    require(t.slot_mib > 0, "transfer.slot_mib", t.slot_mib, "must be > 0 MiB")
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
    require(0.0 <= cfg.cache.fragmentation <= 1.0, "cache.fragmentation", cfg.cache.fragmentation,
            "must be in [0, 1]")
    require(cfg.kernels in ("auto", "torch", "cuda"), "kernels", cfg.kernels, "use auto, torch or cuda")
    require(cfg.device in ("auto", "cpu", "cuda"), "device", cfg.device, "use auto, cpu or cuda")
    return Setup(model, ctx, gen, transfer, cfg)


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> DictConfig:
    """Compose a config outside of a Hydra app (tests, notebooks, pre-checks)."""
    from hydra import compose as hcompose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        cfg = hcompose(config_name, overrides=list(overrides))
    GlobalHydra.instance().clear()
    return cfg


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
