"""The transformers config and class of a run's decode model (``check=decode``'s tiny one, or ``prefill=model``'s at the
preset's width: kvlab.core.decode_spec), and what its weights weigh; kvlab.rank.hf_models builds and runs it."""
from __future__ import annotations

from kvlab.core.decode_spec import MODEL_SUFFIX, ROPE_DIM
from kvlab.core.errors import ConfigError, require
from kvlab.model.spec import INDEXER_HEAD_DIM, LAYER_ATTENTION, LAYER_NONE, LAYER_STATE, ModelSpec

CPU_WEIGHT_BYTES = 256 << 20  # prefill=model on CPUs: a tiny preset's weights (bf16) at most
MAX_POSITIONS = 32768
# weights' spread: transformers' 0.02 leaves a random model's attention almost uniform, and a wrong key then
# moves the logits less than bf16 resolves; wider weights make every cached row count
INIT_STD = 0.1


def layer_types(model: ModelSpec) -> list[str]:
    return ["sliding_attention" if model.layer_window(layer) else "full_attention" for layer in range(model.num_layers)]


# transformers' layer type of each hybrid layer kind (kvlab.model.spec LAYER_*), per family
HYBRID_TYPES = {"qwen3_next": {LAYER_STATE: "linear_attention", LAYER_ATTENTION: "full_attention"},
                "nemotron_h": {LAYER_STATE: "mamba", LAYER_ATTENTION: "attention", LAYER_NONE: "mlp"}}


def hybrid_types(model: ModelSpec) -> list[str]:
    kinds = HYBRID_TYPES[model.decode.family]
    out = []
    for layer in range(model.num_layers):
        k = model.layer_kind(layer)
        if k not in kinds:
            raise ConfigError("model.layer_pattern", model.layer_pattern,
                              f"{model.decode.family} has no layer without a cache ('{k}'); use '*' and 'M'")
        out.append(kinds[k])
    return out


def hf_config(model: ModelSpec):
    """The transformers config of ``model``'s decode model (``model`` as ``kvlab.core.decode_spec.tiny`` made it)."""
    import transformers as tf

    tf.logging.set_verbosity_error()  # the tiny configs' RoPE notes are not the run's business
    d = model.decode
    common = dict(hidden_size=d.hidden_size, num_hidden_layers=model.num_layers, num_attention_heads=d.q_heads,
                  intermediate_size=d.intermediate_size, vocab_size=d.vocab_size,
                  max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                  initializer_range=INIT_STD)
    gqa = dict(common, num_key_value_heads=model.kv_heads, head_dim=model.head_dim)
    sliding = dict(sliding_window=model.window, layer_types=layer_types(model)) if model.window else {}
    if d.family == "llama":
        cfg = tf.LlamaConfig(**gqa)
    elif d.family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**gqa, num_experts=d.experts or 1, num_experts_per_tok=d.experts_per_token,
                                moe_intermediate_size=d.moe_intermediate_size)
    elif d.family == "gpt_oss":
        cfg = tf.GptOssConfig(**gqa, num_local_experts=d.experts or 1, num_experts_per_tok=d.experts_per_token,
                              **sliding)
    elif d.family == "gemma3":
        cfg = tf.Gemma3TextConfig(**gqa, **sliding)
    elif d.family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**gqa, layer_types=hybrid_types(model), linear_num_key_heads=model.state_groups,
                                 linear_num_value_heads=model.state_heads, linear_key_head_dim=model.state_dim,
                                 linear_value_head_dim=model.state_head_dim, linear_conv_kernel_dim=model.conv_kernel,
                                 num_experts=d.experts or 1,
                                 num_experts_per_tok=min(d.experts_per_token, d.experts or 1),
                                 moe_intermediate_size=d.moe_intermediate_size,
                                 shared_expert_intermediate_size=d.moe_intermediate_size)
    elif d.family == "nemotron_h":
        gqa.pop("num_hidden_layers")  # its layers_block_type says how many
        cfg = tf.NemotronHConfig(**gqa, layers_block_type=hybrid_types(model), mamba_num_heads=model.state_heads,
                                 mamba_head_dim=model.state_head_dim, n_groups=model.state_groups,
                                 ssm_state_size=model.state_dim, conv_kernel=model.conv_kernel,
                                 use_mamba_kernels=False)
    else:  # deepseek_v3, deepseek_v32: the latent and its RoPE part make the MLA row
        # transformers' DeepSeek attention wants as many kv heads as query heads (the latent is shared anyway)
        mla = dict(common, num_key_value_heads=d.q_heads, kv_lora_rank=model.mla_dim - ROPE_DIM,
                   qk_rope_head_dim=ROPE_DIM, q_lora_rank=d.q_lora_rank, qk_nope_head_dim=d.qk_nope_head_dim,
                   v_head_dim=d.v_head_dim, n_routed_experts=d.experts or 1,
                   num_experts_per_tok=min(d.experts_per_token, d.experts or 1), n_shared_experts=1,
                   moe_intermediate_size=d.moe_intermediate_size, first_k_dense_replace=1, n_group=1, topk_group=1,
                   rope_scaling=None)
        if d.family == "deepseek_v3":
            cfg = tf.DeepseekV3Config(**mla)
        else:
            from transformers.models.deepseek_v32 import DeepseekV32Config

            cfg = DeepseekV32Config(**mla, index_n_heads=d.indexer_heads, index_head_dim=INDEXER_HEAD_DIM,
                                    index_topk=d.indexer_topk)
    # one attention path per family everywhere (none picked per machine): sdpa prefills a 1024-token prompt
    # about ten times faster than eager on a CPU; gpt-oss's attention sinks have only the eager path
    cfg._attn_implementation = "eager" if d.family == "gpt_oss" else "sdpa"
    return cfg


def _model_class(family: str):
    import transformers as tf

    if family == "deepseek_v32":
        from transformers.models.deepseek_v32 import DeepseekV32ForCausalLM

        return DeepseekV32ForCausalLM
    return {"llama": tf.LlamaForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
            "deepseek_v3": tf.DeepseekV3ForCausalLM, "gpt_oss": tf.GptOssForCausalLM,
            "gemma3": tf.Gemma3ForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM,
            "nemotron_h": tf.NemotronHForCausalLM}[family]


def weight_bytes(model: ModelSpec) -> int:
    """Bytes of ``model``'s transformers weights in bf16, counted on the meta device: nothing is allocated."""
    import torch

    with torch.device("meta"):
        net = _model_class(model.decode.family)(hf_config(model))
    return 2 * sum(p.numel() for p in net.parameters())


def check_on_cpu(model: ModelSpec) -> None:
    """prefill=model on CPUs runs tiny presets only: one line naming the model and what would work."""
    size = weight_bytes(model)
    require(size <= CPU_WEIGHT_BYTES, "model", model.name.removesuffix(MODEL_SUFFIX),
            f"prefill=model on a CPU runs tiny presets only: its {model.num_layers} layers hold {size / 2**20:.0f} "
            f"MiB of weights (at most {CPU_WEIGHT_BYTES >> 20} MiB); use model=tiny_gqa or tiny_mla, fewer layers "
            "(model.run_layers), or device=cuda")
