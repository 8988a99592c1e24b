"""Megatron-LM's top-k router (`ModelConfig.moe_router == "megatron"`): DeepSpeed's MoE layer with its gate routing
as megatron-core's `TopKRouter`, checked against megatron-core's own routing and load-balancing functions (pure torch,
they run on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.errors import ConfigError
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.testing.scenario import tiny_config

MODEL = dataclasses.replace(tiny_config().model, num_experts=(8,), expert_interval=1, moe_router="megatron")


def _megatron_core(logits: torch.Tensor, k: int, pre_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's routing weights (S, E) and its aux loss at coefficient 1 for `logits` (S, E)."""
    from megatron.core.transformer.moe.moe_utils import (
        switch_load_balancing_loss_func,
        topk_routing_with_score_function,
    )

    probs, routing_map = topk_routing_with_score_function(logits, k, use_pre_softmax=pre_softmax)
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # compute_routing_scores_for_aux_loss's softmax
    aux = switch_load_balancing_loss_func(
        scores, routing_map.sum(dim=0), logits.shape[0], k, logits.shape[1], moe_aux_loss_coeff=1.0
    )
    return probs, aux


def _layer(model: ModelConfig, reg: RegularizationConfig | None = None, seed: int = 1234) -> torch.nn.Module:
    reg = reg or RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
    return build_layer_specs(model, reg, seed)[3].build().train()  # token cast, embeddings, then layer 0


@pytest.mark.parametrize(
    "k,pre_softmax", [(1, False), (2, False), (3, False), (8, False), (1, True), (2, True), (3, True)]
)
def test_the_gate_routes_and_balances_as_megatron_cores_topk_router(k: int, pre_softmax: bool) -> None:
    """Same logits: the dense routing weights equal megatron-core's probs (softmax over the k largest logits; with
    --moe-router-pre-softmax the k largest of the softmax over all experts), the load-balancing loss its switch loss,
    and their gradients with respect to the logits agree."""
    model = dataclasses.replace(MODEL, moe_top_k=k, moe_router_pre_softmax=pre_softmax)
    gate = _layer(model).moe.deepspeed_moe.gate
    tokens = torch.randn(48, MODEL.hidden_size, generator=torch.Generator().manual_seed(k))
    logits = torch.nn.functional.linear(tokens, gate.wg.weight).detach().requires_grad_()
    ours_logits = logits.detach().clone().requires_grad_()
    gate.wg.weight.data.zero_()  # the gate's logits come from `ours_logits` through a hook below
    l_aux, _, experts, indices, _, gates, _ = _route(gate, tokens, ours_logits)
    indices, gates = indices.t().long(), gates.t()  # DeepSpeed's routes are (k, S)
    dense = torch.zeros(48, experts).scatter_add(1, indices.clamp(min=0), gates * (indices >= 0))
    probs, aux = _megatron_core(logits, k, pre_softmax)
    torch.testing.assert_close(dense, probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(l_aux, aux, atol=1e-6, rtol=0)
    weights = torch.randn(48, experts, generator=torch.Generator().manual_seed(99))
    ((dense * weights).sum() + 0.3 * l_aux).backward()
    ((probs * weights).sum() + 0.3 * aux).backward()
    torch.testing.assert_close(ours_logits.grad, logits.grad, atol=1e-6, rtol=0)
    assert (dense > 0).sum(dim=1).eq(k).all()  # every token routed to k experts: nothing dropped


def _route(gate: torch.nn.Module, tokens: torch.Tensor, logits: torch.Tensor):
    """The gate's sparse routes for `tokens` with its logits replaced by `logits` (so both sides share one graph)."""
    original = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        return logits if weight is gate.wg.weight else original(x, weight, bias)

    torch.nn.functional.linear = linear
    try:
        return gate(tokens, None, True)
    finally:
        torch.nn.functional.linear = original


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_the_layer_adds_each_tokens_k_experts_weighted_by_megatron_cores_probabilities(pre_softmax: bool) -> None:
    """A whole MoE MLP (DeepSpeed's dispatch, its experts, the combine) equals sum over the k chosen experts of
    probability x expert(token) with megatron-core's probabilities."""
    model = dataclasses.replace(MODEL, moe_top_k=3, moe_router_pre_softmax=pre_softmax)
    layer = _layer(model)
    moe = layer.moe
    x = torch.randn(2, model.seq_length, model.hidden_size, generator=torch.Generator().manual_seed(5))
    out, l_aux, _ = moe(x.transpose(0, 1))
    tokens = x.transpose(0, 1).reshape(-1, model.hidden_size)
    probs, aux = _megatron_core(torch.nn.functional.linear(tokens, moe.deepspeed_moe.gate.wg.weight), 3, pre_softmax)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    expected = sum(probs[:, e : e + 1] * experts[e](tokens) for e in range(8))
    torch.testing.assert_close(out.reshape(-1, model.hidden_size), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l_aux, aux, atol=1e-6, rtol=0)


def test_the_gate_is_drawn_as_megatron_cores_router_normal_with_the_init_std() -> None:
    """N(0, init std) as megatron-core's `Router.reset_parameters` (DeepSpeed's gate: U(-1/sqrt(h), 1/sqrt(h)))."""
    wide = dataclasses.replace(MODEL, hidden_size=256, num_attention_heads=4, ffn_hidden_size=64, num_experts=(64,))
    reg = RegularizationConfig(init_method_std=0.5)
    weight = _layer(wide, reg).moe.deepspeed_moe.gate.wg.weight
    assert abs(weight.std().item() - 0.5) < 0.02 and abs(weight.mean().item()) < 0.01
    assert weight.abs().max().item() > 1.0  # beyond any uniform bound 1/sqrt(256)
    uniform = _layer(dataclasses.replace(wide, moe_router="deepspeed"), reg).moe.deepspeed_moe.gate.wg.weight
    assert uniform.abs().max().item() <= 1 / 16


def test_the_router_stores_what_it_does_and_takes_any_k_up_to_the_experts() -> None:
    model = dataclasses.replace(
        MODEL, moe_top_k=5, moe_token_dropping=True, moe_top2_2nd_expert_sampling=True, moe_min_capacity=9
    )
    assert (model.moe_token_dropping, model.moe_top2_2nd_expert_sampling, model.moe_min_capacity) == (False, False, 4)
    with pytest.raises(ConfigError, match="--moe-router-topk 9 sends each token to 9 experts, but a layer has 8"):
        dataclasses.replace(MODEL, moe_top_k=9)
    with pytest.raises(ConfigError, match="--moe-router-topk"):
        dataclasses.replace(MODEL, moe_top_k=0)
    with pytest.raises(ConfigError, match="--topk 3"):
        dataclasses.replace(MODEL, moe_router="deepspeed", moe_top_k=3)
    with pytest.raises(ConfigError, match="--moe-router"):
        dataclasses.replace(MODEL, moe_router="sinkhorn")
    with pytest.raises(ConfigError, match="--moe-router-pre-softmax is Megatron-LM's router's; with DeepSpeed's"):
        dataclasses.replace(MODEL, moe_router="deepspeed", moe_top_k=2, moe_router_pre_softmax=True)
    dense = dataclasses.replace(MODEL, num_experts=(1,), moe_router_pre_softmax=True)
    assert not dense.moe_router_pre_softmax  # a dense model stores its routing at the defaults


@pytest.mark.parametrize(
    "fields, problem",
    [
        (dict(moe_top_k=3), "--topk 3 is not one of 1, 2"),
        (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax is Megatron-LM's router's; with DeepSpeed's"),
        (dict(moe_shared_expert_size=8), "--moe-shared-expert-intermediate-size 8 is Megatron-LM's router's"),
    ],
)
def test_a_dense_models_routing_is_checked_against_its_router_then_stored_at_the_defaults(
    fields: dict, problem: str
) -> None:
    """ModelConfig's docstrings: a dense model's routing fields are refused where a mixture of experts' would be (with
    DeepSpeed's gates), then stored at their defaults (with Megatron-LM's router)."""
    dense = dataclasses.replace(MODEL, num_experts=(1,), moe_router="deepspeed", moe_top_k=1, add_bias_linear=False)
    with pytest.raises(ConfigError, match=problem):
        dataclasses.replace(dense, **fields)
    with pytest.raises(ConfigError, match=problem):
        dataclasses.replace(dense, num_experts=(8,), **fields)
    stored = dataclasses.replace(dense, moe_router="megatron", **{**fields, "moe_top_k": 3})
    defaults = ModelConfig.__dataclass_fields__
    assert {k: getattr(stored, k) for k in fields} == {k: defaults[k].default for k in fields}
    assert stored.moe_router == defaults["moe_router"].default


def test_each_expert_is_drawn_on_its_own_by_its_global_index() -> None:
    """`moe.draw_experts_apart` (the builder calls it once DeepSpeed's engine has made the expert groups): each expert
    from a generator of its own, fc1 N(0, std), fc2 N(0, std / sqrt(2 L)), as megatron-core draws every local expert;
    the same draw again for the same layer (every rank, every expert-parallel size); DeepSpeed's gates keep copies."""
    from megatron_ds.model import moe

    reg = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05)
    wide = dataclasses.replace(MODEL, hidden_size=128, ffn_hidden_size=256, num_layers=8, num_experts=(4,))
    layers = [_layer(wide, reg), _layer(wide, reg)]
    experts = [layer.moe.deepspeed_moe.experts.deepspeed_experts for layer in layers]
    assert all(torch.equal(experts[0][0].fc1.weight, e.fc1.weight) for e in experts[0])  # DeepSpeed's copies
    assert [moe.draw_experts_apart(layer) for layer in layers] == [4, 4]
    fc1 = [e.fc1.weight for e in experts[0]]
    assert all(not torch.equal(fc1[i], fc1[j]) for i in range(4) for j in range(i + 1, 4))
    assert all(torch.equal(a.fc1.weight, b.fc1.weight) and torch.equal(a.fc2.weight, b.fc2.weight)
               for a, b in zip(*experts))  # fmt: skip
    assert abs(torch.stack(fc1).std().item() - 0.05) < 0.002
    assert abs(torch.stack([e.fc2.weight for e in experts[0]]).std().item() - 0.05 / 4) < 0.0005  # sqrt(2 x 8) = 4
    dense = _layer(dataclasses.replace(wide, moe_router="deepspeed", moe_top_k=2), reg)
    assert moe.draw_experts_apart(dense) == 0
    assert moe.draw_experts_apart(_layer(wide, reg, seed=2**31 - 1)) == 4  # the largest --seed: no overflow
