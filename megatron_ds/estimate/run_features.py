"""How the training software runs a step, as far as its time depends on it: which kernels, what overlaps
what, what is communicated. Pure data; one `RunFeatures` per software the step-time model prices.

`deepspeed_features` is what `pretrain_gpt.py` runs (the planner's candidates); `MEGATRON_LM_2021` and
`MEGATRON_CORE_H100` are the published Megatron runs `benchmarks/planner_vs_published.py` compares with
(their settings are the sources' own: Narayanan et al. 2021, Sec. 4 and 5; the Megatron-LM README's
"Benchmark Configuration" lines).
"""

from __future__ import annotations

from dataclasses import dataclass

FLASH = "flash"
MATH = "math"
DP_AFTER_BACKWARD = "after-backward"
"""The gradient reduction runs once per step after the stage's last backward (DeepSpeed's pipeline engine
`ReduceGrads`, Megatron-LM 2021): nothing hides it but the other stages' remaining work."""
DP_OVERLAP_LAST = "overlap-last"
"""Reduced in buckets while the last micro-batch's backward runs (Megatron-core `--overlap-grad-reduce`)."""
DP_OVERLAP_EACH = "overlap-each"
"""Reduced in buckets during every micro-batch's backward (DeepSpeed ZeRO-2/3 with `overlap_comm`)."""
DP_MODES = (DP_AFTER_BACKWARD, DP_OVERLAP_LAST, DP_OVERLAP_EACH)
WINDOW_CHUNKS = "chunks"
"""A sliding-window layer's queries run in chunks, each against the keys its rows can see (pretrain_gpt.py:
`megatron_ds.model.sliding_window.computed_pairs` scores)."""
WINDOW_BAND = "band"
"""A windowed flash kernel computes the window's band only (Transformer Engine's and flash-attention's
`window_size`, which megatron-core passes)."""
WINDOW_MASKED = "masked"
"""The full score square under a window mask (megatron-core's unfused softmax path)."""
WINDOW_KERNELS = (WINDOW_CHUNKS, WINDOW_BAND, WINDOW_MASKED)


@dataclass(frozen=True)
class RunFeatures:
    """One training software's step, as the time model needs it."""

    name: str
    attention: str = FLASH
    """`flash` (fused attention, causal blocks only, scores recomputed in backward) or `math` (batched
    matmuls over the full score matrix with softmax and dropout kernels between them)."""
    fused_elementwise: bool = False
    """Megatron's fused bias-GeLU, bias-dropout-add and scale-mask-softmax kernels (fewer passes over
    memory) rather than one kernel per torch operation."""
    sequence_parallel: bool = False
    """Norms and dropout on 1/t of the tokens; the tensor-parallel all-reduces become reduce-scatter +
    all-gather of the same volume (Korthikanti et al. 2022)."""
    tp_overlap: bool = False
    """Tensor-parallel communication overlapped with the matmuls beside it (`--tp-comm-overlap`): only the
    part longer than those matmuls is exposed; with sequence parallelism the matmuls run as Transformer
    Engine's userbuffers cut them and share the processors with the communication (`layer_time`)."""
    megatron_cross_entropy: bool = False
    """The loss is Megatron's unfused vocabulary-parallel cross entropy on fp32 logits
    (`layer_time.MEGATRON_CROSS_ENTROPY_BYTES`); False: `CROSS_ENTROPY_BYTES`."""
    dp_mode: str = DP_AFTER_BACKWARD
    grad_bytes: int = 2
    """Bytes per gradient element in the data-parallel reduction."""
    partitioned_optimizer: bool = True
    """The optimizer step updates 1/d of the parameters (ZeRO-1 and up; Megatron's distributed optimizer),
    then the updated parameters are all-gathered; False: every data-parallel rank updates all of them."""
    p2p_scatter_gather: bool = False
    """Each tensor rank sends 1/t of a stage's activation across nodes (Narayanan et al. 2021, Sec. 4.1);
    False: every tensor rank sends the whole tensor."""
    p2p_overlap: bool = False
    """Pipeline sends and receives overlapped with compute (Megatron-core's default; upstream runs it only
    under the interleaved schedule, so the step model applies it only with virtual stages)."""
    delay_grad_reduce: bool = False
    """With `overlap-last`, only the first pipeline stage reduces during its last backward; the others start
    after their last backward, in the bubble (Megatron-core's `--delay-grad-reduce`, on by default at the H100
    table's commit f2e5db402c: training.py sets `grad_sync_func`, and schedules.py then enables the overlapped
    sync only `if config.grad_sync_func is None or rank == 0`)."""
    grad_norm_sync: bool = True
    """Gradient clipping's global-norm all-reduce joins every stage before the optimizer step."""
    window_kernel: str = WINDOW_CHUNKS
    """How a layer with a sliding window attends: one of WINDOW_KERNELS."""

    def __post_init__(self) -> None:
        if self.attention not in (FLASH, MATH):
            raise ValueError(f"attention {self.attention!r} is not flash or math")
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode {self.dp_mode!r} is not one of {', '.join(DP_MODES)}")
        if self.window_kernel not in WINDOW_KERNELS:
            raise ValueError(f"window_kernel {self.window_kernel!r} is not one of {', '.join(WINDOW_KERNELS)}")


def deepspeed_features(
    zero_stage: int, weight_bytes: int, attention: str = FLASH, sequence_parallel: bool = False
) -> RunFeatures:
    """What pretrain_gpt.py runs: torch's SDPA (flash on GPUs), one kernel per torch op, sequence
    parallelism when asked for (`--sequence-parallel`); ZeRO 0/1 on the pipeline engine reduce after backward (ZeRO-0 updates everything), ZeRO-2/3
    on the plain engine with `overlap_comm` (the generated JSON sets it) reduce during every backward."""
    return RunFeatures(
        name=f"pretrain_gpt.py (DeepSpeed, ZeRO-{zero_stage})",
        attention=attention,
        dp_mode=DP_OVERLAP_EACH if zero_stage >= 2 else DP_AFTER_BACKWARD,
        grad_bytes=weight_bytes,
        partitioned_optimizer=zero_stage >= 1,
        sequence_parallel=sequence_parallel,
    )


MEGATRON_LM_2021 = RunFeatures(
    name="Megatron-LM 2021 (Narayanan et al.)",
    attention=MATH,  # before flash attention: batched matmuls and the fused scale-mask-softmax
    fused_elementwise=True,
    grad_bytes=2,  # fp16 gradients all-reduced after backward
    partitioned_optimizer=False,  # no distributed optimizer then
    p2p_scatter_gather=True,
    megatron_cross_entropy=True,
    window_kernel=WINDOW_MASKED,  # no window kernel then (its runs had no window)
)
MEGATRON_CORE_H100 = RunFeatures(
    name="Megatron-core on H100 (Megatron-LM README)",
    attention=FLASH,
    fused_elementwise=True,
    sequence_parallel=True,  # --tp-comm-overlap runs on sequence parallelism
    tp_overlap=True,
    dp_mode=DP_OVERLAP_LAST,  # --overlap-grad-reduce (and --overlap-param-gather)
    delay_grad_reduce=True,  # upstream's default then (--no-delay-grad-reduce turns it off)
    grad_bytes=4,  # bf16 runs reduce fp32 gradients
    partitioned_optimizer=True,
    p2p_scatter_gather=True,
    p2p_overlap=True,  # "PP (enabled by default)"
    megatron_cross_entropy=True,  # no --cross-entropy-loss-fusion among the README's flags
    window_kernel=WINDOW_BAND,  # Transformer Engine's attention takes window_size
)
