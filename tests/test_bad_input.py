"""Bad configurations and requests stop before anything is allocated, with one line naming the
field, the value and what would work: in-process for the whole catalogue, and through the real
``kvlab run`` (exit code 2, one stderr line, nothing written) and the ranks themselves for a few."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvlab.analysis import sweeps as analysis
from kvlab.cli.commands import check_overrides
from kvlab.config.schema import compose
from kvlab.core.errors import ConfigError

GPU = torch.cuda.is_available()
RELIABILITY = Path(__file__).resolve().parent.parent / "docs" / "guide" / "reliability.md"

# (id, overrides, fragments the one line must hold: the field=value it names and the fix it offers).
# The default setup is tiny_gqa (4 layers, 6 kv heads, head_dim 16), ctx tp2 -> gen tp1, 4 x 4096 tokens.
CATALOGUE = [
    # sizes
    ("tokens-per-block-zero", ["gen.tokens_per_block=0"], ["gen.tokens_per_block=0", "positive integer"]),
    ("slot-below-one-token-row", ["transfer.slot_mib=0.0001"], ["transfer.slot_mib=0.0001", "192 B", "use >="]),
    ("slot-zero", ["transfer.slot_mib=0"], ["transfer.slot_mib=0", "> 0"]),
    ("slot-below-one-byte", ["transfer.slot_mib=1e-9"], ["transfer.slot_mib=1e-09", "one byte"]),
    ("slots-zero", ["transfer.slots=0"], ["transfer.slots=0", "positive integer"]),
    ("requests-zero", ["workload.requests=0"], ["workload.requests=0", "positive integer"]),
    ("concurrency-negative", ["workload.concurrency=-1"], ["workload.concurrency=-1", "positive integer"]),
    ("isl-negative", ["workload.isl=-1"], ["workload.isl=-1", "positive integer"]),
    ("num-layers-zero", ["model.num_layers=0"], ["model.num_layers=0", "positive integer"]),
    ("kv-heads-zero", ["model.kv_heads=0"], ["model.kv_heads=0", "positive integer"]),
    ("window-negative", ["model.window=-3"], ["model.window=-3", "0 (full attention)"]),
    ("pack-ctas-zero", ["transfer.pack_ctas=0"], ["transfer.pack_ctas=0", "positive integer"]),
    ("spare-blocks-negative", ["cache.spare_blocks=-2"], ["cache.spare_blocks=-2", ">= 0"]),
    # splits
    ("tp-not-dividing-heads", ["ctx.tp=4"], ["ctx.tp=4", "divisor or a multiple of 6"]),
    # context parallelism (kvlab.model.tokens)
    ("cp-on-gen", ["gen.cp=2"], ["gen.cp=2", "gen.dcp"]),
    ("dcp-on-ctx", ["ctx.dcp=2"], ["ctx.dcp=2", "ctx.cp"]),
    ("cp-zero", ["ctx.cp=0"], ["ctx.cp=0", "positive integer"]),
    ("cp-scheme-unknown", ["ctx.cp=2", "ctx.cp_scheme=ring"], ["ctx.cp_scheme=ring", "contiguous or load_balanced"]),
    # each size is bounded alone; their product, one DP group's ranks, is bounded too, naming the largest
    ("group-too-many-ranks", ["ctx.tp=6", "ctx.cp=400"],
     ["ctx.cp=400", "2,400 ranks", "at most 1,024", "use ctx.cp <= 170"]),
    ("dcp-interleave-not-dividing-block", ["gen.dcp=2", "gen.dcp_interleave=3", "gen.tokens_per_block=16"],
     ["gen.dcp_interleave=3", "tokens_per_block % interleave", "divisor of gen.tokens_per_block=16"]),
    ("dcp-interleave-without-dcp", ["gen.dcp_interleave=4"], ["gen.dcp_interleave=4", "gen.dcp > 1"]),
    ("dcp-with-prefix-reuse", ["gen.dcp=2", "workload=mooncake", "gen.prefix_cache_tokens=65536"],
     ["gen.prefix_cache_tokens=65536", "gen.dcp > 1"]),
    ("cp-with-recurrent-state", ["model=qwen3_next_80b", "ctx.cp=2"], ["ctx.cp=2", "recurrent state", "ctx.cp=1"]),
    ("dcp-heads-over-groups", ["gen.dcp=2", "gen.tp=4"], ["gen.tp=4", "4 DCP groups of 2 ranks"]),
    ("misplaced-run-without-decode", ["fault.misplaced_run=1"], ["fault.misplaced_run=1", "check=decode"]),
    ("gen-tp-not-dividing-heads", ["gen.tp=5"], ["gen.tp=5", "divisor or a multiple of 6"]),
    ("pp-more-than-layers", ["gen.pp=5"], ["gen.pp=5", "pp <= 4"]),
    ("layer-split-wrong-length", ["ctx.pp=2", "ctx.layer_split=[4]"], ["ctx.layer_split=[4]", "per pp stage (2)"]),
    ("layer-split-wrong-sum", ["gen.pp=2", "gen.layer_split=[1,2]"], ["gen.layer_split=[1, 2]", "add up to the 4"]),
    ("layer-split-empty-stage", ["gen.pp=2", "gen.layer_split=[4,0]"], ["gen.layer_split=[4, 0]", "at least one"]),
    ("dp-zero", ["ctx.dp=0"], ["ctx.dp=0", "positive integer"]),
    # incompatible sides and settings
    ("dtypes-mismatch", ["ctx.dtype=fp16", "gen.dtype=bf16"], ["gen.dtype=bf16", "ctx.dtype=fp16"]),
    ("indexer-without-mla", ["model.indexer=true"], ["model.indexer=True", "attention=mla"]),
    ("sliding-layers-without-window", ["model.local_per_global=2"], ["model.local_per_global=2", "window > 0"]),
    ("cuda-kernels-on-cpu-cache", ["kernels=cuda", "device=cpu"], ["kernels=cuda", "kernels=torch"]),
    # unknown names
    ("unknown-model", ["model=foo"], ["model=foo", "llama3_8b"]),
    ("unknown-parallel-preset", ["parallel=tp9"], ["parallel=tp9", "tp2_to_tp1"]),
    ("unknown-strategy", ["transfer.strategy=teleport"], ["transfer.strategy=teleport", "zerocopy"]),
    ("unknown-layout", ["gen.layout=diagonal"], ["gen.layout=diagonal", "block_major, layer_major"]),
    ("unknown-dtype", ["ctx.dtype=int3", "gen.dtype=int3"], ["ctx.dtype=int3", "bf16"]),
    ("unknown-attention", ["model.attention=linear"], ["model.attention=linear", "gqa, mla"]),
    ("unknown-distribution", ["workload.distribution=zipf"], ["workload.distribution=zipf", "lognormal"]),
    ("unknown-kernels", ["kernels=vulkan"], ["kernels=vulkan", "auto, torch or cuda"]),
    ("unknown-device", ["device=tpu"], ["device=tpu", "auto, cpu or cuda"]),
    ("unknown-wandb-mode", ["logger.wandb.mode=foo"], ["logger.wandb.mode=foo", "offline"]),
    ("misspelt-key", ["ctx.tpp=2"], ["ctx.tpp=2", "no such key", "tp, pp, dp"]),
    ("misspelt-group-key", ["workload.isl_lst=[1]"], ["workload.isl_lst=[1]", "no such key", "isl_list"]),
    ("not-an-integer", ["ctx.tp=abc"], ["ctx.tp=abc", "must be an integer"]),
    # a value with a line break, in Hydra's own refusals too, is shown escaped: the line stays one
    ("unknown-key-value-with-newline", ["gen.name='a\nb'"], ["gen.name='a\\nb'", "no such key"]),
    ("not-an-integer-with-newline", ["ctx.tp='a\nb'"], ["ctx.tp='a\\nb'", "must be an integer"]),
    ("not-a-number-in-list", ["workload.isl_list=[a]"], ["workload.isl_list=[a]", "must be an integer"]),
    ("not-a-bool", ["model.indexer=maybe"], ["model.indexer=maybe", "true or false"]),
    # timeouts and ranges
    ("timeout-negative", ["transfer.timeout_s=-5"], ["transfer.timeout_s=-5", "> 0 seconds"]),
    ("timeout-zero", ["transfer.timeout_s=0"], ["transfer.timeout_s=0", "> 0 seconds"]),
    ("timeout-huge", ["transfer.timeout_s=1e300"], ["transfer.timeout_s=1e+300", "at most 1e+06 seconds"]),
    ("layer-compute-negative", ["transfer.layer_compute_ms=-1"], ["transfer.layer_compute_ms=-1", ">= 0"]),
    ("fragmentation-above-one", ["cache.fragmentation=1.5"], ["cache.fragmentation=1.5", "[0, 1]"]),
    ("fragmentation-negative", ["cache.fragmentation=-0.1"], ["cache.fragmentation=-0.1", "[0, 1]"]),
    # workload shapes
    ("isl-max-below-isl-min", ["workload.distribution=uniform", "workload.isl_min=500", "workload.isl_max=100"],
     ["workload.isl_max=100", "isl_min=500"]),
    ("isl-list-empty", ["workload.isl_list=[]"], ["workload.isl_list=[]", "non-empty"]),
    ("isl-list-negative", ["workload.isl_list=[10,-3]"], ["workload.isl_list=[10, -3]", "positive token counts"]),
    # prompt longer than the cache can hold
    ("prompt-longer-than-cache", ["cache.capacity_tokens=1000"],
     ["workload.isl=4096", "cache.capacity_tokens=1000", ">= 4096"]),
    ("lognormal-tail-longer-than-cache", ["workload=lognormal", "cache.capacity_tokens=65536"],
     ["workload.isl_max=131072", "cache.capacity_tokens=65536"]),
    ("listed-prompt-longer-than-cache", ["workload.isl_list=[100,9000]", "cache.capacity_tokens=8192"],
     ["workload.isl_list=[100, 9000]", "9000-token prompt", ">= 9000"]),
    ("capacity-negative", ["cache.capacity_tokens=-1"], ["cache.capacity_tokens=-1", "0 (sized to the workload)"]),
    ("in-flight-requests-exceed-capacity", ["cache.capacity_tokens=4096"],
     ["cache.capacity_tokens=4096", "workload.concurrency", ">= 16384"]),
    # arrivals and traces (tests/test_arrivals.py has the malformed files)
    ("trace-missing", ["workload.arrival=trace", "workload.trace=/nonexistent/t.jsonl"],
     ["workload.trace=/nonexistent/t.jsonl", "no such file", "mooncake_conversation_300.jsonl"]),
    ("trace-not-given", ["workload.arrival=trace"], ["workload.trace=None", "needs a trace file"]),
    ("trace-without-arrival", ["workload.trace=azure_code_2023_300.csv"],
     ["workload.trace=azure_code_2023_300.csv", "arrival=trace"]),
    ("rate-zero", ["workload.arrival=poisson", "workload.rate=0"], ["workload.rate=0", "> 0 requests per second"]),
    ("rate-negative", ["workload.arrival=poisson", "workload.rate=-2"], ["workload.rate=-2", "> 0"]),
    ("rate-infinite", ["workload.arrival=poisson", "workload.rate=inf"], ["workload.rate=inf", "finite"]),
    ("time-scale-zero", ["workload.time_scale=0"], ["workload.time_scale=0", "> 0"]),
    ("time-scale-negative", ["workload=mooncake", "workload.time_scale=-1"], ["workload.time_scale=-1", "> 0"]),
    ("unknown-arrival", ["workload.arrival=sometimes"], ["workload.arrival=sometimes", "burst, poisson or trace"]),
    ("unknown-long-prompts", ["workload.long_prompts=truncate"], ["workload.long_prompts=truncate", "clip or refuse"]),
    ("trace-prompt-refused-by-cache",
     ["workload=mooncake", "cache.capacity_tokens=8192", "workload.long_prompts=refuse"],
     ["workload.trace=mooncake_conversation_300.jsonl", "cache.capacity_tokens=8192", "line "]),
    # prefix reuse on the decode side
    ("prefix-cache-negative", ["workload=mooncake", "gen.prefix_cache_tokens=-1"],
     ["gen.prefix_cache_tokens=-1", ">= 0"]),
    ("prefix-cache-below-one-block", ["workload=mooncake", "gen.prefix_cache_tokens=100"],
     ["gen.prefix_cache_tokens=100", "512-token block", ">= 512"]),
    ("prefix-cache-on-ctx", ["workload=mooncake", "ctx.prefix_cache_tokens=4096"],
     ["ctx.prefix_cache_tokens=4096", "gen.prefix_cache_tokens"]),
    ("prefix-cache-without-hash-ids", ["gen.prefix_cache_tokens=4096"],
     ["gen.prefix_cache_tokens=4096", "hash_ids", "workload=mooncake", "workload.arrival=burst"]),
    ("prefix-cache-trace-without-hash-ids", ["workload=azure_code", "gen.prefix_cache_tokens=4096"],
     ["gen.prefix_cache_tokens=4096", "workload.trace=azure_code_2023_300.csv", "line 2"]),
    ("prefix-cache-with-decode-check", ["workload=mooncake", "gen.prefix_cache_tokens=4096", "check=decode"],
     ["gen.prefix_cache_tokens=4096", "check=bytes"]),
    # fault injection
    ("kill-rank-out-of-range", ["fault.kill_rank=3", "fault.kill_at_chunk=0"], ["fault.kill_rank=3", "[0, 3)"]),
    ("kill-without-chunk", ["fault.kill_rank=1"], ["fault.kill_at_chunk=-1", ">= 0"]),
    ("kill-chunk-past-the-end", ["fault.kill_rank=1", "fault.kill_at_chunk=100000"],
     ["fault.kill_at_chunk=100000", "rank 1 takes part in 4 chunks"]),
    ("stall-negative", ["fault.stall_s=-1"], ["fault.stall_s=-1", ">= 0"]),
    ("flip-without-rank", ["fault.flip_at=[1,2]"], ["fault.flip_rank=-1", "set both"]),
    ("flip-past-the-stream", ["fault.flip_rank=2", "fault.flip_at=[5,25165824]"],
     ["fault.flip_at=[5, 25165824]", "rank 2 moves 25165824 bytes"]),
]
WITHOUT_GPU = [
    ("cuda-kernels-without-gpu", ["kernels=cuda"], ["kernels=cuda", "no CUDA device", "kernels=torch"]),
    ("cuda-device-without-gpu", ["device=cuda"], ["device=cuda", "no CUDA device", "device=cpu"]),
]
if not GPU:
    CATALOGUE += WITHOUT_GPU


def test_catalogue_backs_the_reliability_guide_and_has_no_duplicates():
    """The reliability guide's count of bad inputs is what this file checks, and no case repeats another's
    name or overrides (a repeated one would check nothing new)."""
    claimed = int(re.search(r"\*\*Bad input\*\*: (\d+) invalid configurations", RELIABILITY.read_text()).group(1))
    every = CATALOGUE + ([] if not GPU else WITHOUT_GPU)
    assert len(every) >= claimed
    assert len({c[0] for c in every}) == len(every)
    assert len({tuple(c[1]) for c in every}) == len(every)


@pytest.mark.parametrize("overrides,fragments", [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_one_line_naming_field_value_and_fix(overrides, fragments, monkeypatch):
    # nothing may be allocated: a cache or a staging pool would show up here
    import kvlab.memory.cache
    import kvlab.memory.staging

    def refuse(*a, **k):
        raise AssertionError("allocated before the input was checked")

    monkeypatch.setattr(kvlab.memory.cache.PagedCache, "__init__", refuse)
    monkeypatch.setattr(kvlab.memory.staging.SlotPool, "__init__", refuse)
    msg = check_overrides(overrides)
    assert isinstance(msg, str) and msg, overrides
    assert "\n" not in msg and "Traceback" not in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert len(msg) < 400, msg


def test_what_the_knobs_accept_passes():
    # a rank keeps a request's blocks until its last chunk completes, up to `slots` chunks after it was
    # posted: with one chunk per request and 4 slots, ctx ranks hold all four 4096-token requests at once
    assert check_overrides(["cache.capacity_tokens=16384"]) is None
    assert check_overrides(["workload.isl_list=[100,9000]", "cache.capacity_tokens=32768"]) is None
    assert check_overrides(["fault.kill_rank=1", "fault.kill_at_chunk=3"]) is None
    assert check_overrides(["fault.flip_rank=2", "fault.flip_at=[0,25165823]"]) is None
    assert check_overrides(["fault.stall_rank=0", "fault.stall_at_chunk=0", "fault.stall_s=0.5"]) is None


@pytest.mark.parametrize("overrides,names", [
    (["ctx.tp=4"], "ctx.tp=4"),
    (["cache.capacity_tokens=1000"], "cache.capacity_tokens=1000"),
    (["fault.kill_rank=1", "fault.kill_at_chunk=100000"], "fault.kill_at_chunk=100000"),
    (["ctx.tpp=2"], "ctx.tpp=2"),
    (["workload=mooncake", "gen.prefix_cache_tokens=100"], "gen.prefix_cache_tokens=100"),
], ids=["split", "prompt-longer-than-cache", "fault-past-the-end", "misspelt-key", "prefix-cache-below-one-block"])
def test_kvlab_run_exits_2_with_one_line_and_writes_nothing(overrides, names, tmp_path, kvlab_cli):
    run_dir = tmp_path / "run"
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", "logger=quiet", *overrides, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlab: error: ") and names in lines[0], p.stderr
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_ranks_started_without_the_cli_all_stop_with_one_line(tmp_path, kvlab_cli):
    """Under torchrun the ranks check the plan themselves: every rank exits 2 before allocating, rank 0
    says why in one line, and none of them waits for another."""
    cfg = compose(["logger=quiet", "fault.kill_rank=1", "fault.kill_at_chunk=100000"])
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    procs = kvlab_cli.ranks([tmp_path] * 3, env={"OMP_NUM_THREADS": "1"})
    assert [p.returncode for p in procs] == [2, 2, 2]
    err0 = [ln for ln in procs[0].stderr.splitlines() if ln.startswith("kvlab")]
    assert err0 == [ln for ln in procs[0].stderr.splitlines() if ln.strip()], procs[0].stderr
    assert len(err0) == 1 and "fault.kill_at_chunk=100000" in err0[0]
    assert not any(ln.startswith("kvlab") for p in procs[1:] for ln in p.stderr.splitlines())
    assert not (tmp_path / "parts").exists() and not (tmp_path / "summary.json").exists()


def test_a_refusal_only_another_rank_meets_is_said_once_by_the_launcher(tmp_path, monkeypatch, capsys):
    """A value only one rank's disk or device refuses (a gen rank's decode cache full) is not rank 0's to say: the
    launcher says each refusal rank 0 did not print, once, and leaves no file of them."""
    from kvlab.cli import commands as cli
    from kvlab.cli.launch import Outcome
    from kvlab.results import records

    def launch_local(run_dir, world_size, **kw):  # what the ranks leave when they refuse (kvlab.rank.runner)
        for rank, message in ((0, "x=1: rank 0's"), (1, "KVLAB_DECODE_CACHE=/d: no room"), (2, "x=1: rank 0's"),
                              (3, "KVLAB_DECODE_CACHE=/d: no room")):
            if rank < world_size:
                records.write_refusal(run_dir, rank, message)
        return Outcome(2)

    monkeypatch.setattr("kvlab.cli.run_cmd.launch_local", launch_local)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        cli.main(["run", f"hydra.run.dir={run_dir}", "logger=quiet", "ctx.tp=2", "gen.tp=2"])
    assert e.value.code == 2
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvlab")]
    assert said == ["kvlab: error: KVLAB_DECODE_CACHE=/d: no room"], said
    assert not (run_dir / "parts").exists()


@pytest.mark.parametrize("call,line", [
    (lambda api: api.run_transfer("ctx.tp=4"), "overrides='ctx.tp=4': a list of Hydra overrides, not one string: "
                                               "use ['ctx.tp=4']"),
    (lambda api: api.run_transfer(["ctx.tp=4", 4]), "overrides=['ctx.tp=4', 4]: a list of Hydra overrides"),
    (lambda api: api.run_transfer(7), "overrides=7: a list of Hydra overrides"),
    (lambda api: api.run_transfer([], run_dir=3), "run_dir=3: a directory path"),
    (lambda api: analysis.run_sweep({"transfer": ["chunked"]}, base="workload.isl=64"),
     "base='workload.isl=64': a list of Hydra overrides, not one string"),
])
def test_python_api_arguments_are_type_checked_before_anything_runs(tmp_path, monkeypatch, call, line):
    from kvlab import api

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        call(api)
    assert str(e.value).startswith(line), str(e.value)
    assert list(tmp_path.iterdir()) == []  # no run directory made
