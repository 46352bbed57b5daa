import copy
import dataclasses
import functools
import json

import pytest
import yaml
from omegaconf import OmegaConf, open_dict

from kvlab.config.schema import build, compose
from kvlab.core.errors import ConfigError
from kvlab.core.rates import PROFILES, CostRates, CostSpec
from kvlab.sizing.cost import device_map, predict

MiB = 2**20
H200 = PROFILES["h200"]


def cost_key(key: str) -> str:
    """``+cost.x`` appends a key while conf/config.yaml has no cost group; with one, ``cost.x`` sets it."""
    return f"cost.{key}" if "cost" in _base("tiny_gqa") else f"+cost.{key}"


PARALLEL = {"same": {"ctx.tp": 1, "gen.tp": 1}, "tp2_to_tp1": {"ctx.tp": 2, "gen.tp": 1}}


@functools.cache
def _base(model):
    return compose([f"model={model}", "workload.requests=1"])


@functools.cache
def setup_of(*overrides):
    """Overrides applied to a config composed once per model: composing takes ~0.15 s on a small machine."""
    model, keys = "tiny_gqa", {}
    for ov in overrides:
        k, v = ov.split("=", 1)
        if k == "model":
            model = v
        elif k == "parallel":
            keys.update(PARALLEL[v])
        elif k == "transfer":
            keys["transfer.strategy"] = v
        else:
            keys[k] = yaml.safe_load(v)
    cfg = copy.deepcopy(_base(model))
    for k, v in keys.items():
        with open_dict(cfg):
            OmegaConf.update(cfg, k, v)
    return build(cfg)


def seconds(*overrides, isl=4096, rates=H200):
    return predict(setup_of(*overrides), [isl], rates=rates)


def test_h200_rates_reproduce_the_measured_messages():
    # one message of each measured size alone on the link
    for mib, gbps in zip(H200.link_mib, H200.link_gbps, strict=True):
        n = mib * MiB
        assert n / H200.message_s(n) / 1e9 == pytest.approx(gbps, rel=1e-6)
    # many messages back to back: 4096 x 64 KiB at 4.2 GB/s, 128 x 4 MiB at 142 GB/s
    for count, size, gbps in ((4096, 64 * 1024, 4.2), (128, 4 * MiB, 142.0)):
        assert count * size / (count * H200.message_s(size)) / 1e9 == pytest.approx(gbps, rel=0.1)
    assert 4 * MiB / H200.copy_s(4 * MiB) / 1e9 == pytest.approx(0.9 * 4210 / 2)
    # the pack kernels on few CTAs: ~1.4 TB/s read + write on 16, saturating near the copy rate
    assert 2 * 4 * MiB / H200.copy_s(4 * MiB, ctas=16) / 1e9 == pytest.approx(16 * 88)
    assert H200.copy_s(4 * MiB, ctas=132) == H200.copy_s(4 * MiB)


@pytest.mark.parametrize("strategy", ["naive", "chunked", "layerwise", "zerocopy"])
def test_time_grows_with_bytes(strategy):
    prev = None
    for isl in (256, 1024, 4096, 16384, 65536):
        p = seconds(f"transfer={strategy}", "transfer.layer_compute_ms=0", isl=isl)
        assert p.total_bytes > 0
        if prev is not None:
            assert p.total_bytes > prev.total_bytes
            assert p.seconds > prev.seconds
        prev = p


@pytest.mark.parametrize("parallel", ["same", "tp2_to_tp1"])
@pytest.mark.parametrize("slot_mib", [1, 16, 256])
def test_chunked_never_beats_the_raw_link(parallel, slot_mib):
    p = seconds("model=llama3_8b", f"parallel={parallel}", "transfer=chunked", f"transfer.slot_mib={slot_mib}",
                isl=32768)
    # one gen device receives everything: no faster than the same bytes as one message into it
    assert p.seconds >= p.raw_link_s
    assert p.seconds >= p.total_bytes / (H200.peak_link_gbps * 1e9)
    assert p.gbps <= H200.peak_link_gbps


def test_larger_slots_approach_the_link():
    small = seconds("model=llama3_8b", "parallel=same", "transfer.slot_mib=1", isl=32768)
    large = seconds("model=llama3_8b", "parallel=same", "transfer.slot_mib=256", isl=32768)
    assert small.gbps < 0.6 * large.gbps  # alpha per message dominates small slots
    assert large.gbps > 0.85 * 345  # copies hidden behind the wire, as measured with 256 MiB slots


def test_naive_memory_grows_with_prompt_while_chunked_is_flat():
    naive = [seconds("transfer=naive", isl=isl).extra_bytes for isl in (1024, 8192, 65536)]
    assert naive[0] < naive[1] < naive[2]
    assert naive[2] == pytest.approx(8 * naive[1], rel=0.01)
    for strategy in ("chunked", "layerwise", "zerocopy"):
        flat = {seconds(f"transfer={strategy}", isl=isl).extra_bytes for isl in (1024, 8192, 65536)}
        s = setup_of(f"transfer={strategy}")
        assert flat == {s.transfer.slots * s.transfer.slot_bytes}


def test_naive_memory_is_the_request_share_of_the_busiest_rank():
    s = setup_of("transfer=naive", "ctx.tp=2", "gen.tp=1")
    p = predict(s, [8192], rates=H200)
    # two ctx ranks each send half; the single gen rank receives it all
    assert p.extra_bytes_gen == p.total_bytes
    assert p.extra_bytes_ctx == p.total_bytes // 2
    # the executor keeps `slots` chunks (whole segments here) in flight: two requests' buffers at once
    p2 = predict(s, [8192, 4096], rates=H200, concurrency=2)
    assert p2.extra_bytes_gen == p.total_bytes + predict(s, [4096], rates=H200).total_bytes
    one_slot = predict(setup_of("transfer=naive", "ctx.tp=2", "gen.tp=1", "transfer.slots=1"), [8192], rates=H200)
    assert one_slot.extra_bytes_gen == one_slot.extra_bytes_ctx == p.total_bytes // 2


def test_layerwise_hides_all_but_the_last_layer():
    one_layer = seconds("model=llama3_8b", "model.num_layers=1", "parallel=same", "transfer=chunked",
                        isl=32768).seconds
    def exposed(ms):
        p = seconds("model=llama3_8b", "parallel=same", "transfer=layerwise", f"transfer.layer_compute_ms={ms}",
                    isl=32768)
        return p.requests[0].exposed_s

    # compute per layer at least the per-layer transfer: only the last layer is left after the prefill
    assert exposed(one_layer * 1e3) <= one_layer * 1.001
    assert exposed(10 * one_layer * 1e3) <= one_layer * 1.001
    # no compute to hide behind: the whole transfer is exposed; too little: a backlog builds up
    assert exposed(0) > 20 * one_layer
    assert exposed(0.5 * one_layer * 1e3) > 5 * one_layer


def test_pairs_on_distinct_devices_run_at_once():
    one = seconds("model=llama3_8b", "parallel=same", isl=32768)
    two = seconds("model=llama3_8b", "ctx.tp=2", "gen.tp=2", isl=32768)
    assert two.total_bytes == one.total_bytes
    assert two.seconds == pytest.approx(one.seconds / 2, rel=0.1)
    shared = seconds("model=llama3_8b", "ctx.tp=2", "gen.tp=2", isl=32768, rates=CostRates(devices=1))
    assert shared.seconds > 0.95 * one.seconds  # one device: its link carries every pair in turn


def test_device_map():
    s = setup_of("ctx.tp=2", "gen.tp=1")
    assert device_map(s, 0) == device_map(s, 3) == ([0, 1], [2])
    # two GPUs for three ranks: ctx ranks share GPU0 and gen takes GPU1, so every pair spans two GPUs
    assert device_map(s, 2) == ([0, 0], [1])
    assert device_map(s, 1) == ([0, 0], [0])


def test_fewer_slots_wait_longer():
    one = seconds("model=llama3_8b", "parallel=same", "transfer.slots=1", isl=32768)
    four = seconds("model=llama3_8b", "parallel=same", "transfer.slots=4", isl=32768)
    assert one.seconds > 1.1 * four.seconds


def test_in_place_chunks_skip_the_copies():
    chunked = seconds("parallel=same", "transfer=chunked")
    zero = seconds("parallel=same", "transfer=zerocopy")
    assert zero.requests[0].in_place_chunks == zero.requests[0].chunks > 0
    assert zero.requests[0].pack_s == zero.requests[0].unpack_s == 0
    assert chunked.requests[0].pack_s > 0 and zero.seconds < chunked.seconds


def test_profile_follows_backend_and_overrides():
    cost = setup_of().cost
    assert cost.rates(backend="gloo").profile == "cpu"
    assert cost.rates(backend="nccl").profile == "h200"
    assert cost.rates(backend="cpu:gloo,cuda:nccl").profile == "h200"
    s = setup_of("device=cpu")  # the cost model asks kvlab.config.devices, as the ranks do
    assert predict(s, [1024]).profile == "cpu"
    # keys given on the command line
    cost = build(compose([cost_key("profile=h200"), cost_key("alpha_us=30"), cost_key("link_gbps=[100,200,300,400]"),
                          cost_key("copy_efficiency=0.5")])).cost
    r = cost.rates(backend="gloo")
    assert (r.profile, r.alpha_us, r.link_gbps, r.copy_gbps, r.copy_efficiency) == (
        "h200", 30, (100, 200, 300, 400), 4210, 0.5)
    with pytest.raises(ConfigError, match="cost.profile=tpu"):
        CostSpec(profile="tpu")
    # overrides that make no valid rates stop at build, naming the key
    with pytest.raises(ConfigError, match="cost.link_gbps"):
        CostSpec(profile="cpu", link_gbps=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="one rate per size"):
        CostRates(link_gbps=(1.0,))


def test_fewer_copy_ctas_slow_copy_bound_transfers_only():
    naive = {ctas: seconds("model=llama3_8b", "parallel=same", "transfer=naive", f"transfer.pack_ctas={ctas}",
                           isl=32768).seconds for ctas in (8, 32)}
    assert naive[8] > 1.5 * naive[32]  # one big buffer: pack, send, unpack in turn
    zero = {ctas: seconds("model=llama3_8b", "parallel=same", "transfer=zerocopy", "transfer.slot_mib=128",
                          f"transfer.pack_ctas={ctas}", isl=32768).seconds for ctas in (8, 32)}
    assert zero[8] == pytest.approx(zero[32])  # in place: no copies to slow down


def test_cpu_profile_is_slower_than_h200():
    cpu = seconds(rates=PROFILES["cpu"])
    h200 = seconds()
    assert cpu.profile == "cpu" and cpu.seconds > 100 * h200.seconds


def test_plan_command_writes_the_prediction(tmp_path, capsys):
    from kvlab.cli.commands import main

    main(["plan", f"hydra.run.dir={tmp_path}", "model=llama3_8b", "workload.isl=8192", cost_key("profile=h200")])
    out = json.loads((tmp_path / "plan.json").read_text())
    assert out["total_bytes"] == out["predicted"]["total_bytes"]
    assert out["predicted"]["profile"] == "h200"
    assert 0 < out["predicted"]["gbps"] <= H200.peak_link_gbps
    assert "predicted (h200 rates)" in capsys.readouterr().out


def test_a_runs_prediction_waits_for_its_prefill_timeline_and_starts_at_its_first_chunk():
    """predict_run's view (``with_prefill``): chunks go when the prefill timeline lets them, requests of one ctx
    DP group prefill one after the other, and the run's time starts at its first chunk free to go, as a measured
    makespan does; the prefill's cache writes pace a layer where they outlast it (``fill_gbps``)."""
    from dataclasses import replace

    s = setup_of("prefill.layer_ms=5", "transfer=chunked")
    layers = s.model.num_layers
    p = predict(s, [1024, 1024], rates=H200, with_prefill=True)
    first, second = p.requests
    assert first.ready_s == pytest.approx(layers * 0.005)  # chunked: after its whole prefill
    assert second.ready_s == pytest.approx(2 * layers * 0.005)  # queued behind the first one's prefill
    assert second.end_s > second.ready_s
    assert p.seconds == pytest.approx(max(r.end_s for r in p.requests) - first.ready_s)
    written = first.bytes / s.ctx.size  # tp2 -> tp1: each ctx rank writes and sends half of a request
    slow = replace(H200, fill_gbps=written / (layers * 0.05) / 1e9)  # 50 ms a layer: ten times the layer's 5 ms
    q = predict(s, [1024, 1024], rates=slow, with_prefill=True)
    assert q.requests[0].ready_s == pytest.approx(layers * 0.05, rel=1e-6)


@pytest.mark.parametrize("model", ["tiny_gqa", "tiny_mla"])
@pytest.mark.parametrize("transport", ["p2p", "ipc"])
def test_a_conversion_the_kernels_make_in_the_copy_costs_no_pass_of_its_own(model, transport):
    """gen fp8 (the ``convert`` path): the converting copy reads the ctx rank's bf16 rows and writes the fp8 ones
    once, so it costs what moving those bytes costs; torch's staged conversion (a CPU rank's) copies the wire's
    bytes and then passes over the bf16 ones again: twice as long."""
    base = [f"model={model}", "parallel=same", f"transport={transport}", "transfer=chunked"]
    plain, fp8 = build(compose(base)), build(compose([*base, "gen.kv_dtype=fp8"]))
    staged_rates = dataclasses.replace(H200, convert_in_copy=False)
    one = predict(fp8, [4096], rates=H200).requests[0]
    two = predict(fp8, [4096], rates=staged_rates).requests[0]
    bf16 = predict(plain, [4096], rates=H200).requests[0]
    side = "unpack_s" if transport == "ipc" else "pack_s"  # a pull converts in its copy, p2p in the pack
    fused, staged, copy = getattr(one, side), getattr(two, side), getattr(bf16, side)
    assert fused == pytest.approx(staged / 2, rel=1e-9)
    # the bytes: bf16 read once, fp8 written once, against bf16 read and written by the plain copy (a copy's time
    # is linear in its bytes, so however the slots cut the two)
    assert fused == pytest.approx(copy * (one.bytes + bf16.bytes) / (2 * bf16.bytes), rel=1e-9)
    assert one.bytes < bf16.bytes


def test_a_conversion_the_kernels_leave_to_torch_costs_its_pass_on_a_gpu_too():
    # bf16 -> fp16 is no fp8 conversion: kvlab plan's `staged` path, whatever the rates
    s = build(compose(["parallel=same", "transport=ipc", "gen.kv_dtype=fp16"]))
    staged = predict(s, [4096], rates=dataclasses.replace(H200, convert_in_copy=False)).requests[0]
    assert predict(s, [4096], rates=H200).requests[0].unpack_s == staged.unpack_s > 0
    assert not PROFILES["cpu"].convert_in_copy  # a CPU rank converts in torch
