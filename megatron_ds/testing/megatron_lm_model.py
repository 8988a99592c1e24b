"""megatron-core's `GPTModel` of a recorded Megatron-LM launch line, built on a CPU gloo rank as Megatron-LM builds
it (for `megatron_lm_ranks`): the TransformerConfig from the args as `core_transformer_config_from_args` takes them,
the local layer spec (with --num-experts the block spec Megatron-LM's gpt_builders takes: SequentialMLP experts),
CPU initialisation, and the shims megatron-core needs on the CPU (`cpu_shims`: its sequence-parallel allocations
on the CPU (`model.megatron_core_cpu`), DeepSpeed's RNG tracker in place of its CUDA one, `torch.cuda.synchronize` /
`current_device` answered for the CPU (the checkpoint writer calls them), `torch.ones` given the CPU where asked for
CUDA (megatron-core's sliding-window mask, `on_cpu`), and the MoE router's `te_general_gemm` (undefined without
Transformer Engine in 0.16.1) set to None; with P > 1 and tied weights the embedding copy's `.cuda()` is kept on the
CPU while the model is built).

Experts are drawn from Megatron's expert-parallel seed on each expert rank, as its GPU initialisation draws them
(`_draw_experts`); an untrained mixture of experts' norms are drawn too (`_draw_norms`), so that a misplaced norm
changes the logits.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch


def transformer_config(a: argparse.Namespace) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    activation = torch.nn.functional.silu if a.swiglu else torch.nn.functional.gelu
    return TransformerConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        ffn_hidden_size=a.ffn_hidden_size,
        kv_channels=a.kv_channels,
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,  # each stage's first layer number
        normalization=a.normalization,
        layernorm_epsilon=a.layernorm_epsilon,
        layernorm_zero_centered_gamma=a.layernorm_zero_centered_gamma,
        gated_linear_unit=a.swiglu,
        activation_func=activation,
        # Megatron-LM's fused bias-GeLU is GeLU's tanh approximation: the activation its runs compute
        bias_activation_fusion=a.bias_swiglu_fusion if a.swiglu else a.bias_gelu_fusion,
        add_bias_linear=a.add_bias_linear,
        add_qkv_bias=a.add_qkv_bias,
        qk_layernorm=a.qk_layernorm,
        qk_l2_norm=a.qk_l2_norm,
        hidden_dropout=a.hidden_dropout,
        attention_dropout=a.attention_dropout,
        init_method_std=a.init_method_std,
        params_dtype=a.params_dtype,
        bf16=a.bf16,
        use_cpu_initialization=True,
        pipeline_dtype=a.params_dtype,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        window_size=getattr(a, "window_size", None),
        window_attn_skip_freq=getattr(a, "window_attn_skip_freq", None),
        **_moe_fields(a),
    )


def _moe_fields(a: argparse.Namespace) -> dict[str, Any]:
    """A mixture of experts' options as `core_transformer_config_from_args` takes them: every `moe_*` field of
    TransformerConfig from the arg of its name, `num_moe_experts` from --num-experts ({} without experts)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    if not getattr(a, "num_experts", None):
        return {}
    names = [f.name for f in dataclasses.fields(TransformerConfig) if f.name.startswith("moe_") and hasattr(a, f.name)]
    return {
        **{name: getattr(a, name) for name in names},
        "num_moe_experts": a.num_experts,
        "expert_model_parallel_size": a.expert_model_parallel_size,
        "expert_tensor_parallel_size": a.expert_tensor_parallel_size,
    }


def build_model(a: argparse.Namespace) -> Any:
    """This rank's stage of the model (embedding on the first stage, the output layer on the last)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    config = transformer_config(a)
    assert not config.moe_grouped_gemm, "--moe-grouped-gemm runs CUDA kernels: the fixture builds SequentialMLP"
    spec = get_gpt_layer_local_spec(normalization=a.normalization, qk_layernorm=a.qk_layernorm, qk_l2_norm=a.qk_l2_norm)
    if config.num_moe_experts:  # Megatron-LM's gpt_builders (--transformer-impl local): MoE layers by moe_layer_freq
        spec = get_gpt_decoder_block_spec(config, False, normalization=a.normalization, qk_l2_norm=a.qk_l2_norm)
    cuda = torch.Tensor.cuda
    # With P > 1 and tied weights the last stage's copy of the embedding is moved with `.cuda()` before
    # the all-reduce that copies the first stage's into it: kept on the CPU here.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        model = GPTModel(
            config,
            spec,
            vocab_size=a.padded_vocab_size,
            max_sequence_length=a.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
            position_embedding_type=a.position_embedding_type,
            rotary_percent=a.rotary_percent,
            rotary_base=a.rotary_base,
            rope_scaling=a.use_rope_scaling,
        )
    finally:
        torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    if config.num_moe_experts:  # written untrained: the norms drawn too, so a misplaced one changes the logits
        _draw_experts(model, a.seed)
        _draw_norms(model, a.seed)
    return model


def _draw_norms(model: Any, seed: int) -> None:
    """The norms' weights 1 + N(0, 0.1), the same on every rank (as after training, not megatron-core's ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):  # input_layernorm, pre_mlp_layernorm, final_layernorm
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))


def _draw_experts(model: Any, seed: int) -> None:
    """Each expert-parallel rank's experts drawn from Megatron's expert-parallel seed, as the GPU initialisation
    does (`_initialize_affine_weight_gpu` under the expert RNG stream): the CPU initialisation draws every layer
    from the one default stream, which would give expert e on each EP rank the same weights."""
    from megatron.core import parallel_state

    ep, etp = parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1024 + 100 * ep + etp)  # Megatron's model_parallel_cuda_manual_seed
        for name, module in model.named_modules():  # decoder.layers.L.mlp.experts.local_experts.i.linear_fc1
            if ".local_experts." in name and name.endswith(("linear_fc1", "linear_fc2")):
                fc1 = name.endswith("linear_fc1")
                (model.config.init_method if fc1 else model.config.output_layer_init_method)(module.weight)


def cpu_shims(seed: int, tensor_rank: int) -> None:
    from megatron_ds.model import megatron_core_cpu, rng
    from megatron_ds.model.tensor_parallel_layers import MODEL_PARALLEL_RNG, share_rng_tracker

    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.ones = on_cpu(torch.ones)  # megatron-core's sliding-window mask is made with torch.ones(device="cuda")
    megatron_core_cpu.install()
    share_rng_tracker()
    rng.set_stream(MODEL_PARALLEL_RNG, seed + 2718 + tensor_rank)  # Megatron's model-parallel seed
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16.1 defines it only with Transformer Engine
        moe_utils.te_general_gemm = None  # the router's gate then computes a plain matmul


def fp32_copy(model: Any, a: argparse.Namespace) -> Any:
    """The same weights (bf16 ones rounded as saved) in an fp32 model: what a converted fp32 model computes."""
    if a.params_dtype == torch.float32:
        return model
    fp32 = build_model(argparse.Namespace(**{**vars(a), "params_dtype": torch.float32, "bf16": False, "fp16": False}))
    fp32.load_state_dict(model.state_dict())
    return fp32


def on_cpu(factory: Any) -> Any:
    """`factory` (torch.ones...) allocating on the CPU when called with a CUDA device."""
    import functools

    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return call
