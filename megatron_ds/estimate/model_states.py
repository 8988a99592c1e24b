"""Model-state bytes (parameters, gradients, optimizer states) per parameter, by precision and ZeRO stage.

Two things live here, kept apart on purpose:

* `state_factors`: bytes per parameter for what DeepSpeed 0.19.8 allocates with the JSON that
  `megatron_ds.training.deepspeed_config.generate` writes and the torch optimizer that
  `megatron_ds.training.optimizer` builds. Each case names the DeepSpeed class and file it was
  read from. Where DeepSpeed's own estimator applies (ZeRO-2 and ZeRO-3, 16-bit, Adam), the
  factors are chosen to equal it, so the planner's numbers and `estimate_zero*` agree.
* `zero2_estimate` / `zero3_estimate`: DeepSpeed's estimator formulas, reproduced term for term
  from `deepspeed/runtime/zero/stage_1_and_2.py::estimate_zero2_model_states_mem_needs` and
  `deepspeed/runtime/zero/stage3.py::estimate_zero3_model_states_mem_needs` (tests compare them
  with the installed functions).

Also here, because the JSON writer and the memory model must agree on them: the optimizer kernel
torch runs (`OPTIMIZER_KERNEL`) and the size of ZeRO-1's communication buckets
(`zero_bucket_elements`); `memory_model.py` counts what both cost. Not counted anywhere: the CUDA
context and allocator fragmentation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one element in the compute (model) dtype."""

OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd": 4}
"""fp32 optimizer state per parameter: Adam exp_avg + exp_avg_sq; SGD momentum_buffer (torch.optim)."""

OFFLOAD_DEVICES = ("none", "cpu", "nvme")

MASTER_BYTES = 4
"""An fp32 copy of a parameter (master weight) or of its gradient."""

OPTIMIZER_KERNEL = {"cuda": "fused", "cpu": "single-tensor"}
"""How torch's AdamW / SGD step runs, by device: the one statement of it. `training/optimizer.py`
builds the optimizer with `optimizer_kernel_options`, and `transients.step_temporaries` counts
its temporaries. `fused` (`torch._fused_adamw_`, `_fused_sgd_`): one kernel per tensor list that
updates in place, no temporaries; the fastest on GPUs. `single-tensor` (foreach=False): one tensor
at a time; AdamW's `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds two fp32
copies of the tensor being stepped (torch/optim/adam.py, `_single_tensor_adam`), SGD with weight
decay one (`grad.add(param, alpha=weight_decay)`). torch's default on CUDA, foreach, would instead
hold copies of every tensor of a group at once (`torch._foreach_sqrt`)."""

OPTIMIZER_TEMPORARIES = {
    ("fused", "adam"): 0,
    ("fused", "sgd"): 0,
    ("single-tensor", "adam"): 2,
    ("single-tensor", "sgd"): 1,
}
"""fp32 copies of the tensor being stepped that the step holds at once, by (kernel, optimizer)."""


def optimizer_kernel_options(device: str) -> dict[str, bool]:
    """The keyword arguments of torch.optim.AdamW / SGD for `OPTIMIZER_KERNEL[device]`."""
    return {"fused": True} if OPTIMIZER_KERNEL[device] == "fused" else {"foreach": False}


MEGATRON_BUCKET_ELEMENTS = 40_000_000
"""Megatron-LM's default gradient bucket: max(40M, 1M x data-parallel size) elements
(megatron/core/distributed/distributed_data_parallel.py)."""


def zero_bucket_elements(params_per_tensor_rank: int, num_stages: int, data_parallel_size: int) -> int:
    """`reduce_bucket_size` = `allgather_bucket_size` of the generated ZeRO-1 JSON, in elements.

    DeepSpeed's default, 5e8, is allocated whole: with pipeline parallelism ZeRO-1's
    `reduce_gradients(pipeline_parallel=True)` appends a buffer of `reduce_bucket_size` elements
    (of the parameters' dtype) to a bucket that `setup_buckets` already gave one, so two are alive
    while gradients are reduced (measured on CPU: 2 x 5e8 x 4 bytes = 3.8 GB for a 2-stage model
    of 7M parameters). We take an average stage's parameters (per tensor rank), so one bucket
    reduces a balanced stage in about one call, capped at Megatron-LM's default bucket. Even (the
    all-gather needs a multiple of 2 elements). The all-gather bucket costs no memory in
    DeepSpeed 0.19.8 (it gathers into views of the flat parameters); it is set alike.
    """
    per_stage = -(-params_per_tensor_rank // num_stages)
    size = max(2, min(per_stage, max(MEGATRON_BUCKET_ELEMENTS, 1_000_000 * data_parallel_size)))
    return size + size % 2


@dataclass(frozen=True)
class StateFactors:
    """Bytes per parameter on one GPU: `*_repl` kept whole on every data-parallel rank, `*_part`
    divided by the data-parallel degree. `gathered` multiplies the largest layer's parameter count
    (ZeRO-3's working set of one gathered layer). `host_part` is what offload moves to CPU/NVMe."""

    param_repl: float
    param_part: float
    grad_repl: float
    grad_part: float
    optim_repl: float
    optim_part: float
    gathered: float = 0.0
    host_part: float = 0.0
    source: str = ""

    def params(self, n: float, dp: int) -> float:
        return n * (self.param_repl + self.param_part / dp)

    def grads(self, n: float, dp: int) -> float:
        return n * (self.grad_repl + self.grad_part / dp)

    def optimizer(self, n: float, dp: int) -> float:
        return n * (self.optim_repl + self.optim_part / dp)

    def host(self, n: float, dp: int) -> float:
        return n * self.host_part / dp

    def per_param(self, dp: int) -> float:
        """Total GPU bytes per parameter (without the gathered-layer term)."""
        return (
            self.param_repl
            + self.grad_repl
            + self.optim_repl
            + (self.param_part + self.grad_part + self.optim_part) / dp
        )


def state_factors(
    precision: str,
    zero_stage: int,
    optimizer: str = "adam",
    offload_optimizer: str = "none",
    offload_param: str = "none",
    accumulating: bool = False,
) -> StateFactors:
    """The byte factors for one configuration (raises ValueError for combinations DeepSpeed rejects);
    `accumulating`: more than one micro-batch per step (an offloaded ZeRO-1/2 optimizer keeps accumulated grads)."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISION_BYTES)}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {zero_stage} is not one of 0, 1, 2, 3")
    if offload_optimizer not in OFFLOAD_DEVICES or offload_param not in OFFLOAD_DEVICES:
        raise ValueError(f"offload devices must be one of {', '.join(OFFLOAD_DEVICES)}")
    if offload_optimizer != "none" and zero_stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage >= 1 (offload_optimizer is a zero_optimization key)")
    if offload_param != "none" and zero_stage != 3:
        raise ValueError("parameter offload (offload_param) exists only in ZeRO stage 3")
    s = OPTIMIZER_STATE_BYTES[optimizer]
    w = PRECISION_BYTES[precision]
    if offload_optimizer != "none":
        nvme = offload_optimizer == "nvme"
        return _offloaded(w, zero_stage, s, offload_param != "none", accumulating, nvme)
    on_device = _fp32(zero_stage, s) if precision == "fp32" else _mixed(precision, zero_stage, s)
    if offload_param != "none":  # ZeRO-3 parameter partitions on the host, the optimizer on the device
        return dataclasses.replace(
            on_device,
            param_part=0,
            host_part=on_device.param_part,
            source=on_device.source + "; offload_param: the parameter partitions live on the host",
        )
    return on_device


def _fp32(zero_stage: int, s: int) -> StateFactors:
    if zero_stage == 0:
        return StateFactors(
            4,
            0,
            4,
            0,
            s,
            0,
            source=(
                "fp32 without ZeRO: DeepSpeed keeps the client torch optimizer as is "
                "(engine._do_optimizer_sanity_check returns no wrapper); no master copy"
            ),
        )
    if zero_stage == 1:
        return StateFactors(
            4,
            0,
            4,
            4,
            0,
            MASTER_BYTES + s,
            source=(
                "fp32 ZeRO-1: DeepSpeedZeroOptimizer (zero/stage_1_and_2.py) keeps full fp32 grads, clones "
                "its fp32 partition (single_partition_of_fp32_groups) and flattens a partition grad in step()"
            ),
        )
    if zero_stage == 2:
        return StateFactors(
            4,
            0,
            0,
            8,
            0,
            MASTER_BYTES + s,
            source=(
                "fp32 ZeRO-2: DeepSpeedZeroOptimizer with partitioned grads (averaged_gradients) and the fp32 "
                "partition's flat gradient in step(), plus the fp32 partition clone (benchmarks/zero_memory.py)"
            ),
        )
    return StateFactors(
        0,
        4,
        0,
        8,
        0,
        MASTER_BYTES + s,
        gathered=8,
        source=(
            "fp32 ZeRO-3: DeepSpeedZeroOptimizer_Stage3 (zero/stage3.py): the param partition, which is the fp32 "
            "master itself (_create_fp32_partitions reuses it when the dtypes match), the grad partitions' flat "
            "buffer (grad_partitions_flat_buffer) and its flattened copy in step() (_prepare_fp32_grad_for_sub_group), "
            "Adam's two moments and the denominator torch's single-tensor AdamW (the CPU kernel) makes over the flat "
            "partition = 24/N; one gathered layer (params + grads) (benchmarks/zero_memory.py)"
        ),
    )


def _mixed(precision: str, zero_stage: int, s: int) -> StateFactors:
    m = MASTER_BYTES
    if zero_stage == 0 and precision == "fp16":
        return StateFactors(
            2,
            0,
            2 + m,
            0,
            m + s,
            0,
            source=(
                "fp16 without ZeRO: FP16_Optimizer (runtime/fp16/fused_optimizer.py): 16-bit params and grads, "
                "fp32 master copy (fp32_groups_flat) and its fp32 flat grads, fp32 optimizer states"
            ),
        )
    if zero_stage == 0:
        return StateFactors(
            2,
            0,
            2 + 2,
            m,
            0,
            m + s,
            source=(
                "bf16 without ZeRO on DeepSpeed's pipeline engine: BF16_Optimizer (runtime/bf16_optimizer.py): "
                "bf16 grads, a gradient-accumulation buffer in data_types.grad_accum_dtype (bf16 by default), "
                "and an fp32 master/grad/state partition split over data parallel ranks (ZeRO-1 like)"
            ),
        )
    if zero_stage == 1:
        return StateFactors(
            2,
            0,
            2,
            m,
            0,
            m + s,
            source=(
                "16-bit ZeRO-1: DeepSpeedZeroOptimizer: full 16-bit grads; fp32 master, fp32 partition grad "
                "and optimizer states partitioned (ZeRO paper P_os)"
            ),
        )
    if zero_stage == 2:
        return StateFactors(
            2,
            0,
            0,
            2 + m,
            0,
            m + s,
            source=(
                "16-bit ZeRO-2: as DeepSpeed's estimate_zero2_model_states_mem_needs: 2 bytes params + "
                "18/N (2 grads16 + 4 grads32 + 4 params32 + 8 Adam states)"
            ),
        )
    return StateFactors(
        0,
        2,
        0,
        m + 2,
        0,
        m + s,
        gathered=4,
        source=(
            "16-bit ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): 2/N 16-bit params, 4/N fp32 master, 8/N Adam states, "
            "4/N fp32 grad and the 2/N 16-bit grad partition (grad_partitions_flat_buffer) = 20/N, + 4 bytes x "
            "largest layer; DeepSpeed's estimate_zero3_model_states_mem_needs counts 18/N (not the 16-bit grads)"
        ),
    )


def _offloaded(
    w: int, zero_stage: int, s: int, params_too: bool, accumulating: bool, nvme: bool = False
) -> StateFactors:
    """Offloaded optimizer: what lives on the host, per parameter and data-parallel rank, as DeepSpeed 0.19.8
    allocates it (measured by benchmarks/zero_memory.py)."""
    host = MASTER_BYTES + MASTER_BYTES + s  # fp32 master, fp32 gradient partition, optimizer states
    if zero_stage <= 2:
        # stage_1_and_2.py with cpu_offload: a pinned 16-bit copy of the partition that the updated weights
        # go back through (param_buffer_of_bit16_for_cpu_offload_groups), and, accumulating over micro-batches,
        # the partition's 16-bit gradients (accumulated_grads_in_cpu)
        host += w + (w if accumulating else 0)
        kept = "16-bit params and grads stay on the GPU" if zero_stage == 1 else "the GPU holds the 16-bit params"
        return StateFactors(
            w,
            0,
            w if zero_stage == 1 else 0,
            0,
            0,
            0,
            host_part=host,
            source=(
                f"ZeRO-{zero_stage} + offload_optimizer (DeepSpeedZeroOptimizer cpu_offload): {kept}; the host "
                "holds the fp32 master, fp32 gradient and optimizer states of the partition, its pinned 16-bit copy "
                "and, accumulating, its 16-bit accumulated gradients (DeepSpeed's estimator: 16 bytes on the host)"
            ),
        )
    if nvme:  # ZeRO-Infinity swaps the fp32 master, gradient and states to NVMe (its host buffers not counted)
        host = 0
    host += w  # ZeRO-3 under offload keeps its 16-bit gradient partition on the host (grad_partitions_flat_buffer)
    if params_too:
        return StateFactors(
            0,
            0,
            0,
            0,
            0,
            0,
            gathered=2 * w,
            host_part=host + (0 if nvme else w),  # NVMe parameter offload swaps the 16-bit partitions there
            source=(
                "ZeRO-3 + offload_param + offload_optimizer: the GPU holds one gathered layer (4 bytes x largest "
                "layer in 16-bit, as estimate_zero3_model_states_mem_needs); the host the 16-bit param and grad "
                "partitions, the fp32 master, grad and optimizer states (the estimator: 18 bytes)"
            ),
        )
    return StateFactors(
        0,
        w,
        0,
        0,
        0,
        0,
        gathered=2 * w,
        host_part=host,
        source=(
            "ZeRO-3 + offload_optimizer: the GPU holds the 16-bit param partition and one gathered layer; the host "
            "the 16-bit grad partition, the fp32 master, grad and optimizer states"
        ),
    )


def zero2_estimate(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(cpu bytes per node, gpu bytes per GPU): DeepSpeed's `estimate_zero2_model_states_mem_needs`."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def zero3_estimate(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(cpu bytes per node, gpu bytes per GPU, largest layer bytes): DeepSpeed's
    `estimate_zero3_model_states_mem_needs`."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        kept = 18 if cpu_offload_params else 16
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        if zero_init:
            cpu_mem = total_params * kept * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = total_params * max(4 * num_gpus_per_node, kept * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory
