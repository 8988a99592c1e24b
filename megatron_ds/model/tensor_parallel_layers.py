"""Tensor parallelism inside pipeline stages, from megatron-core's layers (imported only at T > 1).

Set-up (`setup`): megatron-core's `parallel_state` is initialised with T and P; its tensor,
data and pipeline groups must be the same rank sets as DeepSpeed's 'model', 'data' and 'pipe'
axes (both put tensor innermost, then data, then pipeline), which is checked on every rank at
start-up. megatron-core's RNG tracker is pointed at DeepSpeed's, so there is one tracker for
dropout, megatron-core and activation-checkpoint recomputation (see `megatron_ds.model.rng`).

Layers (each built from the full matrix its spec draws, see `megatron_ds.model.init`):
    ColumnLinear / RowLinear         megatron-core's Column/RowParallelLinear, returning a tensor
    VocabParallelWordEmbedding       the tied word embedding: rows [r*v/T, (r+1)*v/T) of (v, h)
    VocabParallelLMHead              the untied LM head, vocabulary-parallel
    vocab_parallel_cross_entropy_loss  the loss on vocabulary-parallel logits

Contract: hidden states (b, s, h) are replicated over the tensor ranks of a stage (what passes
between stages is unchanged); logits are vocabulary-parallel (b, s, v/T) from the LM head to
the loss. Only the CPU-capable parts of megatron-core are used: CPU initialisation, no
gathered outputs.

Under sequence parallelism (`TensorParallel.sequence_parallel`) the same layers run in
megatron-core's sequence-parallel mode: hidden states are sequence-first and split,
(s/T, b, h), from the embedding's output (`scatter_to_sequence`) to the LM head, whose linear
all-gathers its input (as megatron-core's output layer); column-parallel linears all-gather
their input, row-parallel ones reduce-scatter their output; logits are (s, b, v/T) and the loss
reads its labels in that order. On CPU `megatron_ds.model.megatron_core_cpu` makes megatron-core
allocate there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import ProcessTopology
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)

from megatron_ds.config import Config, ModelConfig, RegularizationConfig
from megatron_ds.model import documents, megatron_core_cpu, naming, rng, weight_grad
from megatron_ds.model.init import draw_normal, gather_fused, init_generator, shard_fused
from megatron_ds.model.tensor_parallel_rank import TensorParallel

FUSED_ROWS_ATTR = "fused_row_parts"
"""Set on a fused weight/bias (QKV, SwiGLU fc1): the full row counts of its parts; each shard holds
its block of every part (`megatron_ds.model.init.shard_fused`)."""
MODEL_PARALLEL_RNG = "model-parallel-rng"
"""megatron-core's tracker name for per-tensor-rank randomness (its own code forks it)."""


class TensorParallelSetupError(RuntimeError):
    """megatron-core's process groups do not match DeepSpeed's topology."""


def setup(config: Config, topology: ProcessTopology) -> TensorParallel:
    """Initialise megatron-core for T = `tensor_model_parallel_size`; check its groups; share the RNG tracker."""
    par = config.parallel
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    _check_divisible(config.model, t)
    if not _initialised_as(t, p):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        # megatron-core's pipeline size only shapes its groups here; the layers' configs keep
        # pipeline size 1 so nothing in megatron-core offsets layer numbers.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=t,
            pipeline_model_parallel_size=p,
            create_gloo_process_groups=False,
            distributed_timeout_minutes=max(1, math.ceil(par.distributed_timeout_minutes)),
        )
    check_groups_match(topology)
    share_rng_tracker()
    if par.sequence_parallel:
        megatron_core_cpu.install()
    if t > 1:
        _quiet_collective_renames()
    tp = TensorParallel(
        size=t,
        rank=parallel_state.get_tensor_model_parallel_rank(),
        group=parallel_state.get_tensor_model_parallel_group(),
        sequence_parallel=par.sequence_parallel,
    )
    stage = topology.get_coord(dist.get_rank()).pipe
    rng.set_stream(MODEL_PARALLEL_RNG, config.training.seed + 100 * stage + 2718 + tp.rank)  # Megatron's seeds
    return tp


def _quiet_collective_renames() -> None:
    """torch 2.13 deprecates the names megatron-core (sequence parallelism) and DeepSpeed's pipeline engine
    (`PartitionedTensor.full`: activations cut across the tensor ranks between stages) call (`all_gather_into_tensor`,
    `reduce_scatter_tensor`) with a FutureWarning on every rank; the collectives are the same, the warning is not
    ours to act on."""
    import warnings

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=f"`torch.distributed.{name}` is deprecated", category=FutureWarning)


def _initialised_as(t: int, p: int) -> bool:
    return (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size() == t
        and parallel_state.get_pipeline_model_parallel_world_size() == p
    )


def _check_divisible(model: ModelConfig, t: int) -> None:
    # Invariants: building the Config has already turned violations into ConfigErrors.
    for what, value in (
        ("heads", model.num_attention_heads),
        ("kv heads", model.kv_heads),
        ("ffn", model.ffn_hidden_size),
        ("vocab", model.vocab_size),
    ):
        assert value % t == 0, f"{what} {value} not divisible by tensor-parallel size {t}"


def check_groups_match(topology: ProcessTopology) -> None:
    """Raise TensorParallelSetupError on every rank unless megatron-core's groups equal DeepSpeed's axes."""
    mine = {
        "model": dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()),
        "data": dist.get_process_group_ranks(parallel_state.get_data_parallel_group()),
        "pipe": dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, groups in enumerate(everyone):
        for axis, ranks in groups.items():
            expected = next(g for g in topology.get_axis_comm_lists(axis) if rank in g)
            if sorted(ranks) != sorted(expected):
                name = {"model": "tensor", "data": "data", "pipe": "pipeline"}[axis]
                raise TensorParallelSetupError(
                    f"rank {rank}: megatron-core's {name}-parallel group is {sorted(ranks)} but DeepSpeed's "
                    f"'{axis}' axis group is {sorted(expected)}; both must order ranks tensor innermost, then "
                    f"data, then pipeline"
                )


def share_rng_tracker() -> None:
    """Point megatron-core's RNG tracker at DeepSpeed's (one tracker for both, CPU-capable)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tensor_parallel import random as mc_random

    # megatron-core's own tracker calls torch.cuda and fails on CPU; DeepSpeed's goes through
    # its accelerator and is the one its activation checkpointing saves and restores.
    mc_random._CUDA_RNG_STATE_TRACKER = rng.tracker()
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    assert get_cuda_rng_tracker() is rng.tracker()


def _layer_config(tp: TensorParallel) -> ModelParallelConfig:
    # CPU initialisation cuts each rank's shard from a full matrix we supply (init_method
    # copies it in); no fused kernels; pipeline size 1 (see setup).
    return ModelParallelConfig(
        tensor_model_parallel_size=tp.size,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        sequence_parallel=tp.sequence_parallel,
        gradient_accumulation_fusion=False,
    )


def _copy_of(full: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def init_method(master: torch.Tensor) -> None:
        with torch.no_grad():
            master.copy_(full)

    return init_method


def _fused_rows_by_rank(full: torch.Tensor, fused_rows: tuple[int, ...], tp: TensorParallel) -> torch.Tensor:
    # megatron-core cuts contiguous blocks; order the rows so block r is shard_fused(.., r).
    return torch.cat([shard_fused(full, fused_rows, tp.size, r) for r in range(tp.size)])


class _OutputOnly:
    """What both parallel linears change in megatron-core's: the output alone (megatron-core returns it with a bias
    that is None here), and its linear run with a weight gradient ZB-H1 may defer (`model/weight_grad.py`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[0]  # type: ignore[misc]

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert not args, args
        return weight_grad.megatron_linear(input, weight, super()._forward_impl, **kwargs)  # type: ignore[misc]


class ColumnLinear(_OutputOnly, ColumnParallelLinear):
    """(.., in) replicated -> (.., out/T): this rank's output features; bias sharded likewise."""

    def __init__(
        self,
        tp: TensorParallel,
        full_weight: torch.Tensor,
        bias: bool = True,
        fused_rows: tuple[int, ...] | None = None,
    ) -> None:
        out_features, in_features = full_weight.shape
        if fused_rows is not None:
            full_weight = _fused_rows_by_rank(full_weight, fused_rows, tp)
        super().__init__(
            in_features,
            out_features,
            config=_layer_config(tp),
            init_method=_copy_of(full_weight),
            bias=bias,
            gather_output=False,
            tp_group=tp.group,
        )
        if fused_rows is not None:  # weight and bias shards are per part: `gather_full` must know
            for p in self.parameters():
                setattr(p, FUSED_ROWS_ATTR, tuple(fused_rows))


class RowLinear(_OutputOnly, RowParallelLinear):
    """(.., in/T) this rank's features -> (.., out) summed over tensor ranks, plus a replicated bias."""

    def __init__(self, tp: TensorParallel, full_weight: torch.Tensor, bias: bool = True) -> None:
        out_features, in_features = full_weight.shape
        super().__init__(
            in_features,
            out_features,
            config=_layer_config(tp),
            init_method=_copy_of(full_weight),
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp.group,
        )


class VocabParallelWordEmbedding(VocabParallelEmbedding):
    """The tied word embedding at T > 1: tokens (b, s) -> (b, s, h), summed over tensor ranks.

    Each tied copy (first and last stage) is built from the same full draw, so tensor rank r's
    shard is the same on both stages; DeepSpeed ties the copies per (data, tensor) coordinate.
    """

    SPEC_NAME = naming.WORD_EMBEDDING

    def __init__(
        self, model: ModelConfig, regularization: RegularizationConfig, init_seed: int, tp: TensorParallel
    ) -> None:
        std = regularization.init_method_std
        full = draw_normal((model.vocab_size, model.hidden_size), std, init_generator(init_seed))
        super().__init__(
            model.vocab_size, model.hidden_size, init_method=_copy_of(full), config=_layer_config(tp), tp_group=tp.group
        )
        self.sequence_first = tp.sequence_parallel

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        """Tokens (b, s) -> (b, s, h); packed documents' ids pass through (`model.documents`)."""
        tokens, ids = documents.split(x)
        return documents.join(super().forward(tokens), ids)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head on the last stage: (b, s, h) -> vocabulary-parallel logits (b, s, v/T); under
        sequence parallelism (s/T, b, h) -> (s, b, v/T), all-gathering the input as megatron-core's output
        layer does (its input is saved split, gathered again in backward)."""
        if self.sequence_first:
            return weight_grad.linear(hidden, self.weight, sequence_group=self.tp_group)
        # Identity forward; in backward the input gradient is summed over tensor ranks.
        return weight_grad.linear(copy_to_tensor_model_parallel_region(hidden, group=self.tp_group), self.weight)


class VocabParallelLMHead(ColumnLinear):
    """The untied LM head at T > 1: (b, s, h) -> vocabulary-parallel logits (b, s, v/T)."""

    SPEC_NAME = naming.UNTIED_LM_HEAD

    def __init__(
        self, model: ModelConfig, regularization: RegularizationConfig, init_seed: int, tp: TensorParallel
    ) -> None:
        std = regularization.init_method_std
        full = draw_normal((model.vocab_size, model.hidden_size), std, init_generator(init_seed))
        super().__init__(tp, full, bias=False)


def scatter_to_sequence(hidden: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The embedding's output (b, s, h), replicated -> this rank's part of the sequence (s/T, b, h), as
    megatron-core's embedding scatters it (`scatter_to_sequence_parallel_region`; backward all-gathers)."""
    return scatter_to_sequence_parallel_region(hidden.transpose(0, 1), group=tp.group)


def vocab_parallel_cross_entropy_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean token cross entropy over unmasked positions, from vocabulary-parallel fp32 logits (b, s, v/T).

    megatron-core's kernel subtracts the max from `logits` in place: they are not valid afterwards.
    """
    return _vocab_parallel_loss(logits, *labels)


def sequence_first_cross_entropy_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`vocab_parallel_cross_entropy_loss` of sequence-first logits (s, b, v/T) (sequence parallelism): the
    labels and mask, batch-first (b, s), are read in that order."""
    targets, loss_mask = labels
    return _vocab_parallel_loss(logits, targets.t().contiguous(), loss_mask.t())


def _vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    losses = vocab_parallel_cross_entropy(logits, targets.long())  # (b, s) or (s, b), the same on every tensor rank
    mask = loss_mask.reshape(-1).float()
    return (losses.reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)


def gather_full(param: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The full (T=1) tensor from every tensor rank's `param` (a collective over the tensor group)."""
    parts = [torch.empty_like(param) for _ in range(tp.size)]
    dist.all_gather(parts, param.detach().contiguous(), group=tp.group)
    fused_rows = getattr(param, FUSED_ROWS_ATTR, None)
    if fused_rows is not None:
        return gather_fused(parts, fused_rows)
    if getattr(param, "tensor_model_parallel", False):
        return torch.cat(parts, dim=param.partition_dim)
    assert all(torch.equal(parts[0], x) for x in parts[1:]), "a replicated parameter differs across tensor ranks"
    return parts[0]
