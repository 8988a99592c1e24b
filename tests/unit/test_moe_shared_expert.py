"""Megatron-LM's shared expert (`--moe-shared-expert-intermediate-size`, `--moe-shared-expert-gate`) beside its top-k
router's experts: our MoE layer against megatron-core 0.16.1's own `MoELayer` (its router, local experts and
`SharedExpertMLP`) given the same weights, on one CPU rank forked from the test (megatron-core's process groups and
its CPU stand-ins stay in that rank)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_ds.config import RegularizationConfig
from megatron_ds.errors import ConfigError
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.testing.launch import forked_gloo_ranks
from megatron_ds.testing.scenario import tiny_config

MODEL = dataclasses.replace(
    tiny_config().model,
    num_experts=(4,),
    expert_interval=1,
    moe_router="megatron",
    moe_top_k=2,
    activation="swiglu",
    add_bias_linear=False,
    moe_shared_expert_size=24,
    moe_loss_coeff=0.01,
)
REG = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05)


def _megatron_core_moe(model: Any, weights: dict[str, torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> dict:
    """megatron-core's MoELayer for `model` with `weights` (our names): its output on `x` (s, b, h) and the gradients
    of (output x w).sum() + its attached load-balancing loss by our names."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.cuda.current_device = lambda: torch.device("cpu")  # the router moves its weight there (this rank only)
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 without Transformer Engine never defines it
        moe_utils.te_general_gemm = None
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        num_moe_experts=model.num_experts[0],
        moe_router_topk=model.moe_top_k,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_aux_loss_coeff=model.moe_loss_coeff,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_size,
        moe_shared_expert_gate=model.moe_shared_expert_gate,
        moe_token_dispatcher_type="allgather",  # the alltoall one makes a CUDA stream
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=model.num_experts[0], moe_grouped_gemm=False)
    layer = MoELayer(config, spec.submodules).train()
    theirs = {"moe.deepspeed_moe.gate.wg.weight": layer.router.weight}
    for e, expert in enumerate(layer.experts.local_experts):
        prefix = f"moe.deepspeed_moe.experts.deepspeed_experts.{e}."
        theirs |= {prefix + "fc1.weight": expert.linear_fc1.weight, prefix + "fc2.weight": expert.linear_fc2.weight}
    shared = layer.shared_experts
    theirs |= {
        "shared_expert.fc1.weight": shared.linear_fc1.weight,
        "shared_expert.fc2.weight": shared.linear_fc2.weight,
    }
    if model.moe_shared_expert_gate:
        theirs["shared_expert.gate.weight"] = shared.gate_weight
    assert set(theirs) == set(weights)
    with torch.no_grad():
        for name, p in theirs.items():
            p.copy_(weights[name])
    out, _ = layer(x)
    (out * w).sum().backward()
    return {"out": out.detach(), "grads": {n: p.grad for n, p in theirs.items()}}


def _on_a_rank(rank: int, model: Any, weights: dict, x: torch.Tensor, w: torch.Tensor, path: str) -> str:
    del rank
    torch.save(_megatron_core_moe(model, weights, x, w), path)  # a file: tensors through the queue die with the rank
    return "saved"


@pytest.mark.parametrize("gate,pre_softmax", [(False, False), (True, True)], ids=["shared", "gated-pre-softmax"])
def test_the_layer_with_a_shared_expert_is_megatron_cores_moe_layer(
    tmp_path: Path, gate: bool, pre_softmax: bool
) -> None:
    """Same weights, same tokens: the MoE MLP's output (routed experts + the (gated) shared expert) and every weight's
    gradient of (output x w).sum() + coefficient x load-balancing loss equal megatron-core's within 1e-6 (fp32)."""
    model = dataclasses.replace(MODEL, moe_shared_expert_gate=gate, moe_router_pre_softmax=pre_softmax)
    layer = build_layer_specs(model, REG, 1234)[3].build().train()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(model.seq_length, 2, model.hidden_size, generator=gen)  # (s, b, h): megatron-core's order
    w = torch.randn(x.shape, generator=gen)
    normed = x.transpose(0, 1)  # our MLP half takes (b, s, h)
    ours = {n: p for n, p in layer.named_parameters() if n.startswith(("moe.", "shared_expert."))}
    from megatron_ds.model import moe

    out, l_aux = moe.run(layer.moe, normed)
    out = out + layer.shared_expert(normed)
    ((out.transpose(0, 1) * w).sum() + model.moe_loss_coeff * l_aux).backward()
    weights = {n: p.detach().clone() for n, p in ours.items()}
    path = str(tmp_path / "theirs.pt")
    assert forked_gloo_ranks(_on_a_rank, 1, str(tmp_path / "store"), model, weights, x, w, path, timeout=120) == [
        "saved"
    ]
    theirs = torch.load(path)
    torch.testing.assert_close(out.transpose(0, 1).detach(), theirs["out"], atol=1e-6, rtol=0)
    for name, p in ours.items():
        torch.testing.assert_close(p.grad, theirs["grads"][name], atol=1e-6, rtol=0, msg=name)


def test_the_shared_expert_is_drawn_as_megatron_cores_and_refused_where_it_means_nothing() -> None:
    """fc1 N(0, std), fc2 N(0, std / sqrt(2 L)), the gate N(0, std) (megatron-core's init_method for `gate_weight`)."""
    wide = dataclasses.replace(MODEL, hidden_size=128, num_layers=8, moe_shared_expert_size=256,
                               moe_shared_expert_gate=True)  # fmt: skip
    shared = build_layer_specs(wide, REG, 1234)[3].build().shared_expert
    assert shared.fc1.weight.shape == (512, 128) and shared.fc2.weight.shape == (128, 256)
    assert abs(shared.fc1.weight.std().item() - 0.05) < 0.002
    assert abs(shared.fc2.weight.std().item() - 0.05 / 4) < 0.0005  # sqrt(2 x 8) = 4
    assert shared.gate.weight.shape == (1, 128) and abs(shared.gate.weight.std().item() - 0.05) < 0.015
    with pytest.raises(ConfigError, match="--moe-shared-expert-intermediate-size 24 is Megatron-LM's router's"):
        dataclasses.replace(MODEL, moe_router="deepspeed")
    with pytest.raises(ConfigError, match="--moe-shared-expert-gate gates the shared expert, and there is none"):
        dataclasses.replace(MODEL, moe_shared_expert_size=0, moe_shared_expert_gate=True)
    dense = dataclasses.replace(MODEL, num_experts=(1,), moe_shared_expert_gate=True)
    assert (dense.moe_shared_expert_size, dense.moe_shared_expert_gate) == (0, False)
