"""What runs on each rank of `megatron_lm_checkpoints.write_checkpoints`: megatron-core builds, trains and saves
the launch line's model as Megatron-LM would, and computes the reference logits.

    python -m megatron_ds.testing.megatron_lm_ranks NAME DIRECTORIES_JSON ITERATION OUT OPTIMIZER DP BUCKET

(started by `write_checkpoints` through `testing.launch.run_ranks`, one process per rank, on gloo). On T x P
(x EP) ranks (x DP replicas) megatron-core builds its `GPTModel` (local layer spec; with --num-experts the block
spec Megatron-LM's gpt_builders takes, SequentialMLP experts; CPU initialisation, the model's options taken from
the recorded args as Megatron-LM's `core_transformer_config_from_args` takes them), steps its own
`OptimizerParamScheduler` through the iterations (or, without experts, trains with its DDP and Adam), and saves
what Megatron-LM's `save_checkpoint` saves: `torch_dist` through `dist_checkpointing.save` (megatron-core's sharded
state dict), `torch` as one `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` per tensor rank, stage and expert rank
(written by each expert-data-parallel group's first rank). Then it runs the model (in fp32) forward on `TOKENS`
and saves the logits (tensor shards gathered) to OUT.

CPU shims: megatron-core's sequence-parallel allocations on the CPU (`model.megatron_core_cpu`), DeepSpeed's RNG
tracker in place of its CUDA one, `torch.cuda.synchronize` / `current_device` answered for the CPU (the
checkpoint writer calls them), `torch.ones` given the CPU where asked for CUDA (megatron-core's sliding-window
mask), with P > 1 and tied weights the embedding copy's `.cuda()` kept on the CPU, and the MoE router's
`te_general_gemm` (undefined without Transformer Engine in 0.16.1) set to None. Experts are drawn from Megatron's
expert-parallel seed on each expert rank, as its GPU initialisation draws them (`_draw_experts`). With an optimizer,
torch's factories given a CUDA device allocate on the CPU and `Tensor.type()` answers CUDA's names
(`_optimizer_shims`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from megatron_ds.testing.megatron_lm_checkpoints import OPTIMIZERS, TOKENS, TRACKER, namespace, recorded


def _transformer_config(a: argparse.Namespace) -> Any:
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


def _model(a: argparse.Namespace) -> Any:
    """This rank's stage of the model (embedding on the first stage, the output layer on the last)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    config = _transformer_config(a)
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


def _cpu_shims(seed: int, tensor_rank: int) -> None:
    from megatron_ds.model import megatron_core_cpu, rng
    from megatron_ds.model.tensor_parallel_layers import MODEL_PARALLEL_RNG, share_rng_tracker

    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.ones = _on_cpu(torch.ones)  # megatron-core's sliding-window mask is made with torch.ones(device="cuda")
    megatron_core_cpu.install()
    share_rng_tracker()
    rng.set_stream(MODEL_PARALLEL_RNG, seed + 2718 + tensor_rank)  # Megatron's model-parallel seed
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16.1 defines it only with Transformer Engine
        moe_utils.te_general_gemm = None  # the router's gate then computes a plain matmul


def _logits(model: Any, a: argparse.Namespace) -> torch.Tensor | None:
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


def _fp32_copy(model: Any, a: argparse.Namespace) -> Any:
    """The same weights (bf16 ones rounded as saved) in an fp32 model: what a converted fp32 model computes."""
    if a.params_dtype == torch.float32:
        return model
    fp32 = _model(argparse.Namespace(**{**vars(a), "params_dtype": torch.float32, "bf16": False, "fp16": False}))
    fp32.load_state_dict(model.state_dict())
    return fp32


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
    _cpu_shims(a.seed, parallel_state.get_tensor_model_parallel_rank())
    torch.manual_seed(a.seed)
    model = _model(a)
    scheduler, trained = _scheduler_state(a, iteration), None
    if optimizer != "none":  # torch_dist after every step with the optimizer; the other formats at the end
        scheduler, trained = _train(a, model, directories.get("torch_dist"), optimizer, iteration, bucket)
    for fmt, directory in directories.items():
        if optimizer == "none" or fmt != "torch_dist":
            _save(a, model, directory, fmt, iteration, {"opt_param_scheduler": scheduler, "optimizer": trained})
        if dist.get_rank() == 0:
            with open(os.path.join(directory, TRACKER), "w") as f:
                f.write(str(iteration))
    logits = _logits(_fp32_copy(model, a), a)
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
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
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
    a.use_distributed_optimizer = kind != "local"
    a.dist_ckpt_optim_fully_reshardable = kind == "fully_reshardable"
    a.distrib_optim_sharding_type = kind  # dp_zero_gather_scatter: Megatron-LM's torch_dist default in core 0.5-0.6
    a.clip_grad = 0.0  # megatron-core's gradient clipping asserts CUDA tensors: the runs here do not clip
    ddp = DistributedDataParallel(
        _transformer_config(a),
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
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    plain_type = torch.Tensor.type

    def type_name(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            return plain_type(self).replace("torch.", "torch.cuda.", 1)
        return plain_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_name  # type: ignore[method-assign,assignment]


def _on_cpu(factory: Any) -> Any:
    """`factory` (torch.ones...) allocating on the CPU when called with a CUDA device."""
    import functools

    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return call


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
