"""Megatron-LM checkpoints written by megatron-core itself, for the conversion tests.

    from megatron_ds.testing.megatron_lm_checkpoints import write_checkpoint
    reference = write_checkpoint("llama", "/tmp/mlm", fmt="torch_dist", iteration=5)

The run's `args` are those Megatron-LM's own argument code produced for a launch line
(tests/data/megatron_lm_args.json, recorded by tools/capture_megatron_lm_args.py). On the line's ranks (gloo),
megatron-core builds its `GPTModel` from those args, steps its own `OptimizerParamScheduler` (or trains with its
Adam), saves what Megatron-LM's `save_checkpoint` saves (`torch_dist` through `dist_checkpointing.save`, `torch`
as one `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` per tensor rank, stage and expert rank) and runs the model (in fp32, after the
save) forward on fixed tokens: the logits returned, the reference a converted model must reproduce. What runs on
each rank, its CPU shims included, is `testing.megatron_lm_ranks`. Its fused activations run eagerly
(`TORCHDYNAMO_DISABLE=1`): the same formulas, without torch.compile's build.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import json
import os
import tempfile
from typing import Any

import torch

from megatron_ds.testing.zygote import RUN_PRELOAD

RECORDED = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "megatron_lm_args.json")
FORMATS = ("torch_dist", "torch")
OPTIMIZERS = ("local", "local_pre_mcore_014", "fully_reshardable", "dp_reshardable", "dp_zero_gather_scatter")
TOKENS = ((3, 17, 42, 99, 5, 64, 7, 23, 88, 1, 0, 50), (9, 8, 7, 6, 5, 4, 3, 2, 1, 60, 70, 80))
TRACKER = "latest_checkpointed_iteration.txt"


VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_qkv_bias_qk_l2_norm": ("llama", {"add_qkv_bias": True, "qk_l2_norm": True}),
    # hidden / heads is 8; the window: layers 1 and 2 see 4 keys of TOKENS' 12, layer 3 all
    "llama_kv_channels_window": (
        "llama",
        {"kv_channels": 12, "qk_layernorm": True, "window_size": (3, 0), "window_attn_skip_freq": 3},
    ),
    # Qwen2-MoE's routing: a gated shared expert of 40 beside the experts, top-2 of a softmax over all 4 experts
    "mixtral_shared": (
        "mixtral",
        {"moe_shared_expert_intermediate_size": 40, "moe_shared_expert_gate": True, "moe_router_pre_softmax": True},
    ),
}
"""A recorded line with flags added whose only effect on the args is their own values (Megatron-LM's
validate_args derives nothing from --add-qkv-bias, --qk-layernorm, --qk-l2-norm, a given --kv-channels, --window-size,
--window-attn-skip-freq, --moe-shared-expert-intermediate-size, --moe-shared-expert-gate or --moe-router-pre-softmax):
name -> (the recorded line, the changed args)."""


def recorded(name: str) -> dict[str, Any]:
    """{"world_size", "argv", "args"} of one recorded launch line (or of a VARIANTS line)."""
    base, changes = VARIANTS.get(name, (name, {}))
    with open(RECORDED) as f:
        line = json.load(f)[base]
    flags = [a for k, v in changes.items() for a in (f"--{k.replace('_', '-')}", *(() if v is True else (_flag(v),)))]
    return {**line, "argv": [*line["argv"], *flags], "args": {**line["args"], **changes}}


def _flag(value: Any) -> str:
    """A value as Megatron-LM's command line spells it (a tuple as its tuple_type reads it: "3,0")."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def namespace(saved: dict[str, Any]) -> argparse.Namespace:
    """The recorded args as the Namespace Megatron-LM pickles (torch dtypes and Megatron's enums restored)."""

    def value(v: Any) -> Any:
        if isinstance(v, dict) and "torch.dtype" in v:
            return getattr(torch, v["torch.dtype"])
        if isinstance(v, dict) and "enum" in v:
            module, _, cls = v["enum"].rpartition(".")
            kind: type[enum.Enum] = getattr(importlib.import_module(module), cls)
            return kind[v["name"]]
        return [value(x) for x in v] if isinstance(v, list) else v

    return argparse.Namespace(**{k: value(v) for k, v in saved.items()})


def write_checkpoint(
    name: str,
    directory: str,
    fmt: str,
    iteration: int = 5,
    optimizer: str | None = None,
    timeout: float = 240,
    data_parallel: int = 1,
    bucket_size: int | None = None,
) -> dict[str, Any]:
    """Write launch line `name`'s checkpoint at `iteration` into `directory` (its --save); return
    {"tokens", "logits"} of megatron-core's forward (float32, full vocabulary).

    `optimizer` (P = 1 only): train `iteration` steps on fixed tokens with megatron-core's Adam, `local`
    (Megatron-LM without --use-distributed-optimizer; `local_pre_mcore_014`: saved with --dist-ckpt-save-pre-mcore-014,
    a ChainedOptimizer's states prefixed `chained_<i>.`) or its distributed optimizer saved as
    `fully_reshardable` (--dist-ckpt-optim-fully-reshardable), `dp_reshardable` (the default) or
    `dp_zero_gather_scatter` (core 0.5-0.6's); torch_dist is saved after every step from 1 to `iteration`
    with the optimizer's state, `torch` once at the end with the optimizer's `state_dict()` (and the
    distributed optimizer's `distrib_optim.pt`). None: no training, no optimizer state (--no-save-optim).
    `data_parallel`: replicas of the line's T x P ranks (the saved args' data_parallel_size), each training
    on the same tokens. `bucket_size`: megatron-core's DDP with --overlap-grad-reduce and buckets of that
    many elements (None: one bucket). A mixture-of-experts line (--num-experts: "mixtral") trains with
    megatron-core's ChainedOptimizer (the dense parameters' optimizer, then the experts')."""
    return write_checkpoints(name, {fmt: directory}, iteration, optimizer, timeout, data_parallel, bucket_size)


def write_checkpoints(
    name: str,
    directories: dict[str, str],
    iteration: int = 5,
    optimizer: str | None = None,
    timeout: float = 240,
    data_parallel: int = 1,
    bucket_size: int | None = None,
) -> dict[str, Any]:
    """`write_checkpoint` of one model in several formats (format -> directory), from one launch."""
    from megatron_ds.testing.launch import run_ranks

    assert set(directories) <= set(FORMATS), directories
    world = recorded(name)["world_size"] * data_parallel
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "reference.pt")
        ranks = "megatron_ds.testing.megatron_lm_ranks"
        argv = ["-m", ranks, name, json.dumps(directories), str(iteration), out, optimizer or "none"]
        argv += [str(data_parallel), str(bucket_size or 0)]
        # megatron-core wraps its fused bias-GeLU/SwiGLU in torch.compile; eager runs the same formulas without
        # inductor's C++ build (on a fresh machine ~2.5 CPU-minutes for these fixtures).
        env = {"PYTHONPATH": _root(), "TORCHDYNAMO_DISABLE": "1"}
        run_ranks(argv, world, timeout=timeout, env=env, preload=RUN_PRELOAD)
        return torch.load(out, weights_only=True)


def _root() -> str:
    return os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
