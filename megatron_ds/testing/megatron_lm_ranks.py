"""What runs on each rank of `megatron_lm_checkpoints.write_checkpoints`: megatron-core builds, trains and saves
the launch line's model as Megatron-LM would, and computes the reference logits.

    python -m megatron_ds.testing.megatron_lm_ranks NAME DIRECTORIES_JSON ITERATION OUT OPTIMIZER DP BUCKET

(started by `write_checkpoints` through `testing.launch.run_ranks`, one process per rank, on gloo). On T x P
(x EP) ranks (x DP replicas) megatron-core builds its `GPTModel` (`megatron_lm_model`: as Megatron-LM builds it,
with the CPU shims), steps its own `OptimizerParamScheduler` through the iterations (or trains with its DDP and
Adam: a ChainedOptimizer with experts), and saves what Megatron-LM's `save_checkpoint` saves: `torch_dist` through
`dist_checkpointing.save` (megatron-core's sharded state dict), `torch` as one
`mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` per tensor rank, stage and expert rank (written by each
expert-data-parallel group's first rank). Then it runs the model (in fp32) forward on `TOKENS` and saves the logits
(tensor shards gathered) to OUT. With an optimizer, torch's factories given a CUDA device allocate on the CPU and
`Tensor.type()` answers CUDA's names (`_optimizer_shims`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from megatron_ds.testing.megatron_lm_checkpoints import OPTIMIZERS, TOKENS, TRACKER, namespace, recorded
from megatron_ds.testing.megatron_lm_model import build_model, cpu_shims, fp32_copy, on_cpu, transformer_config


def reference_logits(model: Any, a: argparse.Namespace) -> torch.Tensor | None:
    """The full logits on the last stage's ranks (stages pass hidden states with send/recv); None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tokens = torch.tensor(TOKENS)
    s = tokens.shape[1]
    positions = torch.arange(s).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: masked
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    hidden_shape = (s, tokens.shape[0], a.hidden_size)
    model.eval()
    with torch.no_grad():
        if stage > 0:
            hidden = torch.empty(hidden_shape)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        local = model(tokens if stage == 0 else None, positions, mask).float()
        if stage < stages - 1:
            dist.send(local.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    pieces = [torch.empty_like(local) for _ in range(a.tensor_model_parallel_size)]
    dist.all_gather(pieces, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1)


def _scheduler(a: argparse.Namespace, optimizer: Any) -> Any:
    """megatron-core's own OptimizerParamScheduler, as Megatron-LM builds it from the args (iterations)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = a.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=a.lr_warmup_init,
        max_lr=a.lr,
        min_lr=a.min_lr,
        lr_warmup_steps=a.lr_warmup_iters * gbs,
        lr_decay_steps=(a.lr_decay_iters or a.train_iters) * gbs,
        lr_decay_style=a.lr_decay_style,
        start_wd=a.start_weight_decay,
        end_wd=a.end_weight_decay,
        wd_incr_steps=a.train_iters * gbs,
        wd_incr_style=a.weight_decay_incr_style,
    )


def _scheduler_state(a: argparse.Namespace, iteration: int) -> dict[str, Any]:
    """The scheduler's state after `iteration` steps (without an optimizer to drive)."""
    gbs = a.global_batch_size
    scheduler = _scheduler(a, argparse.Namespace(param_groups=[{"lr": a.lr, "weight_decay": a.weight_decay}]))
    for _ in range(iteration):
        scheduler.step(increment=gbs)
    return scheduler.state_dict()


def _main(
    name: str, directories: dict[str, str], iteration: int, out: str, optimizer: str, dp: int, bucket: int
) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo")
    a = namespace(recorded(name)["args"])
    a.data_parallel_size, a.world_size = a.data_parallel_size * dp, a.world_size * dp  # as validate_args derives
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        expert_model_parallel_size=a.expert_model_parallel_size,
        expert_tensor_parallel_size=a.expert_tensor_parallel_size,
    )
    cpu_shims(a.seed, parallel_state.get_tensor_model_parallel_rank())
    torch.manual_seed(a.seed)
    model = build_model(a)
    scheduler, trained = _scheduler_state(a, iteration), None
    if optimizer != "none":  # torch_dist after every step with the optimizer; the other formats at the end
        scheduler, trained = _train(a, model, directories.get("torch_dist"), optimizer, iteration, bucket)
    for fmt, directory in directories.items():
        if optimizer == "none" or fmt != "torch_dist":
            _save(a, model, directory, fmt, iteration, {"opt_param_scheduler": scheduler, "optimizer": trained})
        if dist.get_rank() == 0:
            with open(os.path.join(directory, TRACKER), "w") as f:
                f.write(str(iteration))
    logits = reference_logits(fp32_copy(model, a), a)
    first_replica = parallel_state.get_data_parallel_rank() == 0
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0 and first_replica:
        torch.save({"tokens": torch.tensor(TOKENS), "logits": logits}, out)
    dist.destroy_process_group()


def _save(a: argparse.Namespace, model: Any, directory: str, fmt: str, iteration: int, extra: dict[str, Any]) -> None:
    """What Megatron-LM's save_checkpoint writes at `iteration` (`extra`: the scheduler, the optimizer)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    a.consumed_train_samples = iteration * a.global_batch_size
    a.iteration = iteration
    state: dict[str, Any] = {
        "args": a,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 1.0e12 * iteration,
    }
    step = os.path.join(directory, f"iter_{iteration:07d}")
    if fmt == "torch_dist":
        os.makedirs(step, exist_ok=True)
        dist.barrier()
        state["model"] = model.sharded_state_dict()
        optimizer = extra.pop("optimizer", None)
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(state, metadata=_optimizer_metadata(a))
        dist_checkpointing.save({**state, **extra}, step)
    else:
        rank_dir = os.path.join(step, _torch_rank_dir(a))
        os.makedirs(rank_dir, exist_ok=True)
        state["model"] = model.state_dict_for_save_checkpoint()
        optimizer = extra.pop("optimizer", None)
        if optimizer is not None:  # as Megatron-LM's save_checkpoint: the distributed optimizer's own file
            state["optimizer"] = optimizer.state_dict()
            if a.use_distributed_optimizer:
                optimizer.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
        if parallel_state.get_expert_data_parallel_rank() == 0:  # Megatron-LM's writers (EP = 1: data-parallel)
            torch.save({**state, **extra}, os.path.join(rank_dir, "model_optim_rng.pt"))
    dist.barrier()


def _torch_rank_dir(a: argparse.Namespace) -> str:
    """Megatron-LM's `get_checkpoint_name`: mp_rank_TT, then _PPP with P > 1, then the expert rank _EEE with EP > 1
    (each expert rank's file holds its own experts, numbered from 0 as `local_experts.i`)."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if a.pipeline_model_parallel_size > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if a.expert_model_parallel_size > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return name


def _optimizer_metadata(a: argparse.Namespace) -> dict[str, Any]:
    """Megatron-LM's `_build_sharded_state_dict_metadata` for these args."""
    # --dist-ckpt-save-pre-mcore-014 (and megatron-core before 0.14) prefixes a ChainedOptimizer's states `chained_<i>.`
    avoid_prefix = not getattr(a, "dist_ckpt_save_pre_mcore_014", False)
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": avoid_prefix}
    if a.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = a.distrib_optim_sharding_type
    return metadata


def _train(
    a: argparse.Namespace, model: Any, directory: str | None, kind: str, iterations: int, bucket: int = 0
) -> tuple[dict[str, Any], Any]:
    """`iterations` steps of megatron-core's DDP and Adam on fixed tokens, saving after each into `directory`
    (torch_dist) when given; the scheduler's state and the optimizer at the end."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    assert kind in OPTIMIZERS and a.pipeline_model_parallel_size == 1, (kind, a.pipeline_model_parallel_size)
    _optimizer_shims()
    a.use_distributed_optimizer = not kind.startswith("local")
    a.dist_ckpt_save_pre_mcore_014 = kind == "local_pre_mcore_014"
    a.dist_ckpt_optim_fully_reshardable = kind == "fully_reshardable"
    a.distrib_optim_sharding_type = kind  # dp_zero_gather_scatter: Megatron-LM's torch_dist default in core 0.5-0.6
    a.clip_grad = 0.0  # megatron-core's gradient clipping asserts CUDA tensors: the runs here do not clip
    ddp = DistributedDataParallel(
        transformer_config(a),
        DistributedDataParallelConfig(
            use_distributed_optimizer=a.use_distributed_optimizer,
            overlap_grad_reduce=bucket > 0,
            bucket_size=bucket or None,
        ),
        model,
    )
    config = OptimizerConfig(
        optimizer="adam",
        lr=a.lr,
        min_lr=a.min_lr,
        weight_decay=a.weight_decay,
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        adam_eps=a.adam_eps,
        bf16=a.bf16,
        params_dtype=a.params_dtype,
        use_distributed_optimizer=a.use_distributed_optimizer,
        clip_grad=a.clip_grad,
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    gbs = a.global_batch_size
    scheduler = _scheduler(a, optimizer)
    tokens = torch.tensor(TOKENS)
    s = tokens.shape[1]
    positions = torch.arange(s).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    labels = torch.roll(tokens, -1, dims=1)
    ddp.train()
    for iteration in range(1, iterations + 1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp(tokens, positions, mask, labels=labels).float().mean().backward()
        finalize_model_grads([ddp])  # Megatron-LM's step: the DDP sync, then q/k_layernorm grads summed over T
        optimizer.step()
        scheduler.step(increment=gbs)
        if directory is not None:
            extra = {"optimizer": optimizer, "opt_param_scheduler": scheduler.state_dict()}
            _save(a, model, directory, "torch_dist", iteration, extra)
    return scheduler.state_dict(), optimizer


def _optimizer_shims() -> None:
    """megatron-core's DDP and optimizers allocate with `device='cuda'` and check `Tensor.type()` for CUDA
    names: on the CPU, factories given a CUDA device allocate on the CPU and `type()` answers CUDA's names."""
    for name in ("tensor", "zeros", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    plain_type = torch.Tensor.type

    def type_name(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            return plain_type(self).replace("torch.", "torch.cuda.", 1)
        return plain_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_name  # type: ignore[method-assign,assignment]


if __name__ == "__main__":
    _main(
        sys.argv[1],
        json.loads(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
        int(sys.argv[6]),
        int(sys.argv[7]),
    )
