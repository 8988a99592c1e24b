"""Mixture-of-experts MLPs: DeepSpeed's MoE layer around our MLP, as Megatron-DeepSpeed 4efb479 builds it.

A transformer layer with experts (`ModelConfig.experts_per_layer`) replaces its MLP by `deepspeed.moe.layer.MoE`:
a top-k gate (a bias-free linear h -> experts, in fp32), `num_experts / E` local copies of the MLP on each rank of an
expert-parallel group of E ranks (tokens reach their expert through DeepSpeed's all-to-all), and with `--mlp-type
residual` (PR-MoE) a dense MLP beside them whose output is mixed with the experts' by a learned two-way softmax
(`coefficient`, h -> 2). What matches Megatron-DeepSpeed's `ParallelTransformerLayer` and DeepSpeed:

  * every expert (and the residual MLP) is a copy of one MLP (DeepSpeed's `Experts` deep-copies the module it is
    given), whose weights are drawn as the dense MLP of that layer would be; the gate's and the coefficient's
    weights are drawn like torch's `nn.Linear` default, U(-1/sqrt(h), 1/sqrt(h)), from the layer's generator;
  * the expert (and the residual MLP) adds its fc2 bias itself (with --add-bias-linear): at 4efb479 Megatron-DeepSpeed's
    `ParallelMLP` builds its `dense_4h_to_h` without `skip_bias_add`, so the bias is inside the output DeepSpeed's
    `Experts` keeps (its "Ignore the bias term" drops the `None` beside it);
  * the tokens go to the gate sequence-first, (s x b, h), Megatron's order, which decides who keeps a slot when an
    expert is over capacity;
  * the layer's load-balancing loss (`l_aux`) is kept on the module after each forward; the model's loss adds
    `--moe-loss-coeff` x their sum (`GPTModel.moe_loss`), as pretrain_gpt.py's `forward_step` does.

Random choices come from torch's default generator, as in DeepSpeed: random token selection when an expert is over
capacity (nothing is dropped with `--disable-moe-token-dropping`) and top-2's sampled second expert (argmax with
`--disable-moe-top2-2nd-expert-sampling`). Without them routing is deterministic, and a run equals the one-process
run of the same global batch (`tests/dist/test_moe_expert_parallel.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron_ds.config import ModelConfig
from megatron_ds.model import naming, sharding
from megatron_ds.model.init import draw_normal, init_generator

EXPERT_PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."
"""Where a transformer layer's local experts sit among its parameter names (`moe.` is the layer's attribute)."""
GATE_WEIGHT = "moe.deepspeed_moe.gate.wg.weight"
SHARED_EXPERT_PREFIX = "shared_expert."
"""Where a transformer layer's shared expert (`SharedExpert`) sits among its parameter names, after the MoE layer's."""


class ExpertMLP(nn.Module):
    """fc2(act(fc1(x))): one expert, or PR-MoE's residual MLP; (.., h) in and out."""

    def __init__(
        self, fc1: torch.Tensor, fc2: torch.Tensor, fc1_bias: bool, activation: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(fc1.shape[1], fc1.shape[0], bias=fc1_bias)
        self.fc2 = nn.Linear(fc2.shape[1], fc2.shape[0], bias=fc1_bias)  # biases as --disable-bias-linear says
        with torch.no_grad():
            self.fc1.weight.copy_(fc1)
            self.fc2.weight.copy_(fc2)
            if fc1_bias:
                self.fc1.bias.zero_()
                self.fc2.bias.zero_()
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class SharedExpert(nn.Module):
    """megatron-core's `SharedExpertMLP` (Megatron-LM's `--moe-shared-expert-intermediate-size`): fc2(act(fc1(x))) of
    its own FFN width, no biases, for every token; with `--moe-shared-expert-gate` times sigmoid(gate(x)), a bias-free
    linear h -> 1 (megatron-core's `gate_weight`, Qwen2-MoE's `shared_expert_gate`). (.., h) in and out; the layer adds
    it to the routed experts' output (`TransformerLayer.mlp`)."""

    def __init__(
        self,
        fc1: torch.Tensor,
        fc2: torch.Tensor,
        gate_weight: torch.Tensor | None,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(fc1.shape[1], fc1.shape[0], bias=False)
        self.fc2 = nn.Linear(fc2.shape[1], fc2.shape[0], bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(fc1)
            self.fc2.weight.copy_(fc2)
        self.gate: nn.Linear | None = None
        if gate_weight is not None:  # registered after fc1 and fc2: megatron-core's parameter order
            self.gate = nn.Linear(gate_weight.shape[1], 1, bias=False)
            with torch.no_grad():
                self.gate.weight.copy_(gate_weight)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(self.activation(self.fc1(x)))
        if self.gate is None:
            return out
        return out * torch.sigmoid(self.gate(x))  # (.., 1): one weight per token


def build_shared_expert(
    model: ModelConfig,
    activation: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator,
    std: float,
    out_std: float,
) -> SharedExpert | None:
    """The shared expert of a layer with experts (None without `moe_shared_expert_size`), drawn from `generator` after
    the MoE layer's gate as megatron-core draws `SharedExpertMLP`: fc1 N(0, `std`), fc2 N(0, `out_std`) (the dense
    MLP's rules, `transformer.linear_stds`), the gate weight N(0, `std`) (its `init_method`)."""
    size = model.moe_shared_expert_size
    if not size:
        return None
    h = model.hidden_size
    fc1 = draw_normal((2 * size if model.gated_mlp else size, h), std, generator)
    fc2 = draw_normal((h, size), out_std, generator)
    gate = draw_normal((1, h), std, generator) if model.moe_shared_expert_gate else None
    return SharedExpert(fc1, fc2, gate, activation)


def build(
    model: ModelConfig,
    num_experts: int,
    expert_parallel_size: int,
    expert: ExpertMLP,
    generator: torch.Generator,
    init_std: float,
) -> nn.Module:
    """DeepSpeed's MoE layer of `num_experts` copies of `expert`, configured from `model`'s MoE fields; its gate (and
    PR-MoE's coefficient) drawn from `generator` (Megatron-LM's router: N(0, `init_std`), as megatron-core's
    `Router.reset_parameters`). Its process groups are made by DeepSpeed's engine."""
    from deepspeed.moe.layer import MoE

    layer = MoE(
        model.hidden_size,
        expert,
        num_experts=num_experts,
        ep_size=expert_parallel_size,
        k=model.moe_top_k,
        capacity_factor=model.moe_train_capacity_factor,
        eval_capacity_factor=model.moe_eval_capacity_factor,
        min_capacity=model.moe_min_capacity,
        use_residual=model.mlp_type == "residual",
        drop_tokens=model.moe_token_dropping,
        top2_2nd_expert_sampling=model.moe_top2_2nd_expert_sampling,
    )
    bound = 1.0 / math.sqrt(model.hidden_size)  # torch's nn.Linear default: kaiming_uniform(a=sqrt(5)), fan-in h
    gate = layer.deepspeed_moe.gate
    linears = [gate.wg] if model.moe_router == "deepspeed" else []
    if model.mlp_type == "residual":
        linears.append(layer.coefficient)
    with torch.no_grad():
        for linear in linears:
            for p in linear.parameters():
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=generator))
        if model.moe_router == "megatron":
            gate.wg.weight.copy_(torch.empty(gate.wg.weight.shape).normal_(0.0, init_std, generator=generator))
            gate.__class__ = megatron_router()
            gate.pre_softmax = model.moe_router_pre_softmax
    return layer


@functools.cache
def megatron_router() -> type:
    """DeepSpeed's `TopKGate` routing as Megatron-LM's `TopKRouter` (softmax score function, no scaling factor, no
    capacity). By default DeepSpeed's `topkgating` at every k, without dropping: it takes the softmax over all experts
    and renormalizes it over the k chosen, which is megatron-core's softmax over the k largest logits, and its
    load-balancing loss E^2 / k x mean_e(mean probability_e x routed share_e) is megatron-core's
    `switch_load_balancing_loss_func`. With `pre_softmax` (`--moe-router-pre-softmax`) the k largest probabilities
    are the weights as they are (`pre_softmax_gating`); the loss is the same (all checked in
    tests/unit/test_moe_megatron_router.py). DeepSpeed's own gate would use its top-1 or top-2 function at k = 1 or 2
    (a top-1 weight of the softmax score, a top-2 loss over the first choice only)."""
    from deepspeed.moe.sharded_moe import TopKGate, topkgating

    class MegatronRouter(TopKGate):
        pre_softmax = False

        def forward(
            self, input: torch.Tensor, used_token: Any = None, sparse_routes: bool = False, use_tutel: bool = False
        ) -> Any:
            logits = nn.functional.linear(input.float(), self.wg.weight.float())  # fp32, as DeepSpeed's gate
            if self.pre_softmax:
                assert sparse_routes, "DeepSpeed's MoE layer asks for sparse routes"
                return pre_softmax_gating(logits, self.k, self.ep_group)
            factor = self.capacity_factor if self.training else self.eval_capacity_factor  # unused: nothing dropped
            return topkgating(
                logits, self.k, factor, self.min_capacity, False, self.ep_group, sparse_routes=sparse_routes
            )

    return MegatronRouter


def pre_softmax_gating(logits: torch.Tensor, k: int, ep_group: Any) -> tuple[torch.Tensor, ...]:
    """Megatron-LM's `--moe-router-pre-softmax` routing of fp32 `logits` (S, E) in the sparse form DeepSpeed's
    `topkgating` returns (its no-dropping branch): (l_aux, capacity, E, expert indices (k, S), slot locations (k, S),
    weights (k, S), tokens per expert). The weights are the softmax over all experts at the k chosen, not
    renormalized; the capacity is the most tokens any expert of the expert-parallel group got."""
    import torch.distributed as dist

    gates = nn.functional.softmax(logits, dim=1)  # (S, E)
    num_experts = gates.shape[1]
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)  # (S, k)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    capacity = exp_counts.max()
    if ep_group is not None and dist.get_world_size(group=ep_group) > 1:
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ep_group)
    locations = (torch.cumsum(mask, dim=0) - 1).gather(1, top_idx)
    routes = (top_idx.to(torch.int32), locations.to(torch.int32), top_gate)
    return (l_aux, capacity, num_experts, *(r.t().contiguous() for r in routes), exp_counts)


EXPERT_SEED_STRIDE = 1_000_003
"""Expert e of a layer drawn with seed (layer seed x this + e + 1) mod 2^63 (`draw_experts_apart`): one stream per
expert."""


@torch.no_grad()
def draw_experts_apart(module: nn.Module) -> int:
    """Draw each expert of Megatron-LM's router's layers in `module` on its own, as megatron-core initializes every
    local expert (fc1 from N(0, std), fc2 from N(0, std / sqrt(2 L)), the dense MLP's rules), where DeepSpeed's
    `Experts` copied one MLP: expert e from its own generator (`EXPERT_SEED_STRIDE`), by its global index, so the model
    is the same at every expert-parallel size. Called once DeepSpeed's engine has made the expert-parallel groups
    (`training.builder`); returns the experts drawn."""
    drawn = 0
    for owner in module.modules():
        rules = getattr(owner, "expert_init", None)
        if rules is None:
            continue
        seed, std, out_std = rules
        layer = owner.moe
        for expert, index in zip(layer.deepspeed_moe.experts.deepspeed_experts, local_expert_ids(layer), strict=True):
            gen = init_generator((seed * EXPERT_SEED_STRIDE + index + 1) % 2**63)  # a large --seed too
            expert.fc1.weight.copy_(draw_normal(expert.fc1.weight.shape, std, gen))
            expert.fc2.weight.copy_(draw_normal(expert.fc2.weight.shape, out_std, gen))
            drawn += 1
    return drawn


def route_every_token(layer: nn.Module) -> None:
    """Make DeepSpeed MoE `layer`'s gate send every token to its top-k experts by score, whatever else is in the batch:
    no token dropped (each expert's capacity is the most tokens any expert got, as `--disable-moe-token-dropping`),
    top-2's second expert the best other one (no Gumbel sample, as `--disable-moe-top2-2nd-expert-sampling`), no
    minimum capacity (DeepSpeed's top-1 gate asserts at least that many tokens: one token is a KV-cached step) and no
    random token selection (it only picks among tokens over capacity, and would draw from torch's default generator).
    A token's output then depends on that token alone, which decoding with a KV cache needs (`megatron_ds.inference`);
    DeepSpeed's eval-mode gate would instead drop tokens over `eval_capacity_factor` x tokens / experts in each
    forward and sample top-2's second expert."""
    gate = layer.deepspeed_moe.gate
    gate.drop_tokens = False
    gate.top2_2nd_expert_sampling = False
    gate.min_capacity = 0
    gate.use_rts = False


def run(layer: nn.Module, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, s, h) -> the MoE output (b, s, h) and the layer's load-balancing loss (a scalar)."""
    out, l_aux, _ = layer(normed.transpose(0, 1))  # (s, b, h): Megatron's token order at the gate
    return out.transpose(0, 1), l_aux


def is_expert(name: str) -> bool:
    """A parameter name of a local expert (held by one rank of the expert-parallel group)."""
    return EXPERT_PREFIX in name


def global_expert_name(name: str, expert_parallel_rank: int, num_local_experts: int) -> str:
    """`name` with its local expert index replaced by the global one: rank r's expert i is expert r x local + i, the
    name the one-process model gives it."""
    head, tail = name.split(EXPERT_PREFIX, 1)
    local, rest = tail.split(".", 1)
    return f"{head}{EXPERT_PREFIX}{expert_parallel_rank * num_local_experts + int(local)}.{rest}"


def expert_parallel_rank(layer: nn.Module) -> int:
    """This rank's place in DeepSpeed MoE `layer`'s expert-parallel group (0 before the engine made the group)."""
    import torch.distributed as dist

    group = layer.deepspeed_moe.ep_group
    return dist.get_rank(group=group) if group is not None else 0


def local_expert_ids(layer: nn.Module) -> range:
    """The global indices of the experts of DeepSpeed MoE `layer` this rank holds: rank r's r x local, ..."""
    first = expert_parallel_rank(layer) * layer.num_local_experts
    return range(first, first + layer.num_local_experts)


def layer_tensor_rules(model: ModelConfig, num_experts: int) -> dict[str, sharding.TensorRule]:
    """Every tensor of a transformer layer with `num_experts` experts, whole (T = 1), under the names the one-process
    model gives them within the layer: the dense layer's attention and norms, then the MoE layer's gate, each expert's
    fc1 and fc2 (and their biases), PR-MoE's residual MLP and coefficient, and the shared expert's fc1, fc2 and gate, in
    `named_parameters()` order (checked against the built layer in tests/unit/test_moe_universal.py)."""
    dense = sharding.spec_tensors(model, naming.TRANSFORMER_LAYER)
    mlp = {k: r for k, r in dense.items() if k.split(".")[0] in ("fc1", "fc2")}
    out = {k: r for k, r in dense.items() if k.split(".")[0] not in ("fc1", "fc2")}
    out[GATE_WEIGHT] = sharding.TensorRule((num_experts, model.hidden_size))
    for expert in range(num_experts):
        out.update({f"{EXPERT_PREFIX}{expert}.{k}": r for k, r in mlp.items()})
    if model.mlp_type == "residual":
        out.update({f"moe.mlp.{k}": r for k, r in mlp.items()})
        out["moe.coefficient.weight"] = sharding.TensorRule((2, model.hidden_size))
        out["moe.coefficient.bias"] = sharding.TensorRule((2,))
    size, h = model.moe_shared_expert_size, model.hidden_size
    if size:  # split as the dense MLP's (gate and up rows; fc2's columns), as the experts' are
        parts = (size, size) if model.gated_mlp else (size,)
        out[f"{SHARED_EXPERT_PREFIX}fc1.weight"] = sharding.TensorRule((sum(parts), h), sharding.FUSED_ROWS, parts)
        out[f"{SHARED_EXPERT_PREFIX}fc2.weight"] = sharding.TensorRule((h, size), sharding.COLUMNS)
    if model.moe_shared_expert_gate:
        out[f"{SHARED_EXPERT_PREFIX}gate.weight"] = sharding.TensorRule((1, h))
    return out


def global_named_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of `module` by the name the one-process model gives it: local experts renamed to their global
    index (collective-free: each MoE layer knows its expert-parallel group)."""
    ranks = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "deepspeed_moe") and hasattr(sub, "num_local_experts"):
            ranks[name + "."] = (expert_parallel_rank(sub), sub.num_local_experts)
    out = {}
    for name, p in module.named_parameters():
        owner = next((ranks[k] for k in ranks if name.startswith(k) and is_expert(name)), None)
        out[name if owner is None else global_expert_name(name, *owner)] = p
    return out
