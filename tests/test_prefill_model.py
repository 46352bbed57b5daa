"""The prefill time model: FLOPs from the presets' real dimensions against independent counts of
parameters, attention growing with the prompt, and the FIFO timeline per ctx DP group."""
from __future__ import annotations

import pytest

from kvlab.cli.commands import check_overrides
from kvlab.config.schema import build, compose
from kvlab.model.plan import Request
from kvlab.model.prefill import PrefillSpec, causal_pairs, layer_flops, layer_seconds, timeline


def setup_of(*overrides):
    return build(compose(["parallel=same", *overrides]))


def test_causal_pairs():
    assert causal_pairs(1) == 1 and causal_pairs(4) == 10
    assert causal_pairs(4, reach=2) == 1 + 2 + 2 + 2
    assert causal_pairs(4, reach=9) == causal_pairs(4)


# Active parameters per token of the whole model, as the model cards state them, against the sum of
# the per-layer weights the time model charges (2 FLOPs per weight per token, attention left out).
@pytest.mark.parametrize("model,active_b,tol", [
    ("llama3_8b", 8.0 - 2 * 0.525, 0.03),  # 8.03B minus embedding and LM head (128256 x 4096 each)
    ("llama3_70b", 70.6 - 2 * 1.05, 0.03),  # 70.6B minus embedding and LM head (128256 x 8192 each)
    ("qwen3_235b", 22.0 - 2 * 0.62, 0.05),  # 22B active, minus embedding and LM head (151936 x 4096)
    ("deepseek_v3", 37.0 - 2 * 0.93, 0.05),  # 37B active, minus embedding and LM head (129280 x 7168)
    ("gpt_oss_120b", 5.13 - 0.58, 0.05),  # 5.13B active (model card: the unembedding counts, not the embedding)
])
def test_linear_flops_match_active_parameters(model, active_b, tol):
    s = setup_of(f"model={model}")
    # one token: attention over a single key is negligible next to the weights
    weights = sum(layer_flops(s.model, layer, 1) for layer in range(s.model.num_layers)) / 2
    assert weights / 1e9 == pytest.approx(active_b, rel=tol)


def test_attention_grows_with_the_prompt_and_windows_cap_it():
    s = setup_of("model=llama3_8b")
    linear = layer_flops(s.model, 0, 1) - 2 * 32 * 256  # less the one pair a single token attends
    f8, f128 = layer_flops(s.model, 0, 8192), layer_flops(s.model, 0, 131072)
    assert f8 / 8192 < f128 / 131072  # superlinear: the per-token cost grows with the prompt
    attn = f128 - 131072 * linear
    assert attn == pytest.approx(2 * 32 * 256 * causal_pairs(131072), rel=1e-9)
    g = setup_of("model=gemma3_27b")  # layer 0 slides over 1024 tokens, layer 5 is global
    per_tok = [layer_flops(g.model, layer, 131072) / 131072 for layer in (0, 5)]
    assert per_tok[0] < per_tok[1] / 2
    d = setup_of("model=deepseek_v32")  # sparse attention: 2048 keys per query, the indexer sees all
    dv3 = setup_of("model=deepseek_v3")
    assert layer_flops(d.model, 10, 131072) < layer_flops(dv3.model, 10, 131072) / 2


def test_seconds_rate_tp_and_override():
    s = setup_of("model=llama3_8b")
    one = layer_seconds(s.model, s.prefill, 1, 8192)
    two = layer_seconds(s.model, s.prefill, 2, 8192)
    assert two == pytest.approx([x / 2 for x in one])
    assert one[0] == pytest.approx(layer_flops(s.model, 0, 8192) / (989e12 * 0.5))
    # 8k tokens of Llama-3.1-8B: about 0.27 s on one H200 at half its peak
    assert sum(one) == pytest.approx(0.267, rel=0.05)
    fixed = layer_seconds(s.model, PrefillSpec(layer_ms=3.0), 4, 123)
    assert fixed == [0.003] * 32


def test_timeline_fifo_per_group():
    reqs = [Request(0, 10, 0, 0, 0.0), Request(1, 10, 1, 0, 0.0), Request(2, 10, 0, 0, 0.5),
            Request(3, 10, 1, 0, 5.0), Request(4, 10, 0, 0, 0.6)]
    t = timeline(reqs, lambda isl: [0.25] * 4)  # 1 s per request
    assert (t[0].start, t[0].end) == (0.0, 1.0)
    assert (t[1].start, t[1].end) == (0.0, 1.0)  # the other group: in parallel
    assert (t[2].start, t[2].queue, t[2].end) == (1.0, 0.5, 2.0)  # waits for request 0
    assert (t[4].start, t[4].end) == (2.0, 3.0)  # FIFO: after request 2
    assert (t[3].start, t[3].queue) == (5.0, 0.0)  # its group is idle by then
    assert t[2].layer_end == (1.25, 1.5, 1.75, 2.0)


@pytest.mark.parametrize("overrides,fragments", [
    (["model.dims.hidden_size=0"], ["model.dims.hidden_size=0", "positive integer"]),
    (["model=qwen3_235b", "model.dims.moe_intermediate_size=0"], ["model.dims.moe_intermediate_size=0"]),
    (["model=tiny_mla", "model.dims.qk_head_dim=0"], ["model.dims.qk_head_dim=0", "192"]),
    (["prefill.mfu=0"], ["prefill.mfu=0", "[0.001, 1]"]),
    (["prefill.mfu=1.5"], ["prefill.mfu=1.5", "[0.001, 1]"]),
    (["prefill.tflops=-1"], ["prefill.tflops=-1", "[0.001, 1e+09]"]),
    (["prefill.layer_ms=-2"], ["prefill.layer_ms=-2", ">= 0"]),
    (["prefill=tpu"], ["prefill=tpu", "gpu, model, sim"]),
])
def test_bad_prefill_one_line(overrides, fragments):
    msg = check_overrides(overrides)
    assert msg and "\n" not in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_layer_ms_needs_no_dimensions():
    assert check_overrides(["model.dims.hidden_size=0", "prefill.layer_ms=1"]) is None


@pytest.mark.parametrize("model", ["tiny_gqa", "tiny_mla", "tiny_dsa", "tiny_swa"])
@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_prefill_kernels_run_with_the_presets_shapes(model, tp):
    """prefill=gpu's layer code on CPU tensors (shapes only; its timing is measured on the GPU machine): every
    layer runs, its attention takes one rank's share of the preset's heads, and its output is the preset's hidden
    width for every token, finite."""
    import math

    import torch
    from torch.overrides import TorchFunctionMode

    from kvlab.rank.prefill_gpu import GpuPrefill

    class Products(TorchFunctionMode):
        """The result of every matrix product a layer queues (layer() keeps none of them)."""

        def __init__(self):
            super().__init__()
            self.out: list[torch.Tensor] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            r = func(*args, **(kwargs or {}))
            if getattr(func, "__name__", "") in ("matmul", "__matmul__"):
                self.out.append(r)
            return r

    n = 200
    s = setup_of(f"model={model}")
    d = s.model.dims
    g = GpuPrefill(s.model, tp, torch.device("cpu"))
    heads = math.ceil(d.q_heads / tp)
    for layer in range(s.model.num_layers):
        q, k, v = g._qkv(g._input(n))
        assert q.shape[:2] == (n, heads) and k.shape[0] == v.shape[0] == n
        assert g._attention(q, k, v, g._reach(layer)).shape == (n, heads, g.v)
        with Products() as products:
            g.layer(layer, n)
        last = products.out[-1]
        assert last.shape == (n, d.hidden_size) and torch.isfinite(last.float()).all()


@pytest.mark.parametrize("reach,kv_heads", [(0, 2), (16, 2), (7, 4), (64, 4)])
def test_blockwise_attention_is_the_window(reach, kv_heads):
    """The sliding-window / top-k attention of prefill=gpu, by query blocks, equals attention masked to
    the window over the whole prompt."""
    import torch
    import torch.nn.functional as F

    from kvlab.rank.prefill_gpu import GpuPrefill

    s = setup_of("model=tiny_gqa")
    g = GpuPrefill(s.model, 1, torch.device("cpu"))
    g.v = 8
    n, heads = 50, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, 8, generator=gen)
    k, v = (torch.randn(n, kv_heads, 8, generator=gen) for _ in range(2))
    got = g._attention(q, k, v, reach)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (j <= i) & ((j > i - reach) if reach else True)
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                          v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
    assert torch.allclose(got, want, atol=1e-5)
