"""Adam's state of a Megatron-LM `--ckpt-format torch` checkpoint trained without the distributed optimizer,
named by model tensor. Pure reading; nothing of Megatron is imported.

Each rank's `model_optim_rng.pt` holds its optimizer's `state_dict()`: torch's (megatron-core's
`FP32Optimizer`) or `{"optimizer": torch's, "fp32_from_fp16_params": [[master, ...] per group]}`
(`Float16OptimizerWithFloat16Params`, bf16 and fp16 runs: the masters of a group's 16-bit parameters;
its fp32 ones, such as fp32 norms, are their own masters). torch numbers the parameters group by group;
megatron-core's `_get_param_groups` fills each group in `named_parameters()` order (the order of the saved
state dict's tensors) with the parameters of its weight-decay multiplier: 0 for biases and 1-D tensors,
1 for the rest (`get_standard_config_overrides`). So parameter j of a group with `wd_mult` w is the j-th
tensor of that kind in the state dict. Checked for every parameter: its moments have its shape and, where
saved, its fp32 master rounds to its weight exactly. Groups of another kind (a decoupled learning rate,
an lr multiplier, experts) or any mismatch are a `PlacementError`, and the caller converts the weights
without the optimizer state, saying why.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ds.interop.megatron_lm_buckets import PlacementError
from megatron_ds.interop.megatron_lm_files import MegatronLMCheckpoint, RankTensors, load_pickled_state

MOMENTS = ("exp_avg", "exp_avg_sq")
HALF = (torch.bfloat16, torch.float16)


def no_weight_decay(name: str, tensor: torch.Tensor) -> bool:
    """megatron-core's standard override: biases and 1-D tensors take no weight decay."""
    return name.endswith(".bias") or tensor.dim() == 1


class RankParamStates:
    """Each rank file's optimizer state, by the rank's stored tensor names."""

    def __init__(self, ckpt: MegatronLMCheckpoint, ranks: RankTensors, ignored: tuple[str, ...]) -> None:
        self.states: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}
        self.steps: set[float] = set()
        for stage in range(ckpt.pipeline_parallel):
            for rank in range(ckpt.tensor_parallel):
                path = ckpt.rank_file(rank, stage)
                model = ranks.model(rank, stage)
                params = [(k, v) for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith(ignored)]
                saved = load_pickled_state(path).get("optimizer")
                for key, states in _match(path, saved, params, self.steps).items():
                    self.states[stage, rank, key] = states

    def shard(self, stage: int, rank: int, key: str, state: str) -> torch.Tensor:
        """State `state` (`param`: the fp32 master, or the weight where none is saved) of tensor rank `rank`'s
        `key` on `stage`, fp32."""
        return self.states[stage, rank, key][state].float()


def _match(
    path: str, saved: Any, params: list[tuple[str, torch.Tensor]], steps: set[float]
) -> dict[str, dict[str, torch.Tensor]]:
    inner = saved.get("optimizer") if isinstance(saved, dict) and "optimizer" in saved else saved
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) or "param_groups" not in inner:
        raise PlacementError(f"{path}: its optimizer entry is not a torch optimizer's state_dict")
    masters = saved.get("fp32_from_fp16_params")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for g, group in enumerate(inner["param_groups"]):
        if group.get("lr_mult", 1.0) != 1.0 or group.get("is_decoupled_lr") or group.get("is_expert_parallel"):
            raise PlacementError(f"{path}: param group {g} has its own learning rate or experts")
        if "wd_mult" not in group:
            raise PlacementError(f"{path}: param group {g} names no wd_mult (a Megatron-LM of before 2023?)")
        members = [(k, v) for k, v in params if no_weight_decay(k, v) == (group["wd_mult"] == 0.0)]
        numbers = group.get("params") or []
        if len(members) != len(numbers):
            raise PlacementError(f"{path}: param group {g} has {len(numbers)} parameters, the model {len(members)}")
        halves = iter(masters[g] if masters is not None else [])  # masters of the 16-bit ones, in order
        for (key, weight), number in zip(members, numbers):
            state = inner["state"].get(number)
            if not isinstance(state, dict) or any(
                not isinstance(state.get(m), torch.Tensor) or state[m].shape != weight.shape for m in MOMENTS
            ):
                raise PlacementError(f"{path}: parameter {number}'s state is not {key}'s (shape {list(weight.shape)})")
            master = next(halves, None) if weight.dtype in HALF else weight
            if master is None:
                raise PlacementError(f"{path}: param group {g} saves fewer fp32 masters than it has 16-bit parameters")
            if not torch.equal(master.to(weight.dtype), weight):
                raise PlacementError(f"{path}: parameter {number}'s fp32 master is not {key}'s weight")
            if "step" in state:
                steps.add(float(state["step"]))
            out[key] = {"param": master, **{m: state[m] for m in MOMENTS}}
        if next(halves, None) is not None:
            raise PlacementError(f"{path}: param group {g} saves more fp32 masters than it has 16-bit parameters")
    missing = [k for k, _ in params if k not in out]
    if missing:
        raise PlacementError(f"{path}: no param group holds {missing[0]}")
    return out
