"""Knowledge distillation's costs on one rank (`--kd`, `--mos`): the teacher's weights, what the kd loss saves and
allocates, the teacher's forward. Pure: no torch.

As the trainer runs it (`training/distillation.py`, `model/distillation.py`): the teacher is frozen, in eval mode, in
the training precision, 1/T of it on each tensor rank (one whole model at T = 1), outside DeepSpeed's engine (no
gradients, no optimizer state, no ZeRO partitioning or offload). After the student's forward of each training
micro-batch it runs forward under no_grad on the same tokens, then the kd loss compares the two fp32 logits
(b, s, v/T) (the inference model's `.float()` at T = 1, `logits_to_fp32` at T > 1), before the lm loss.

Saved for the student's backward (equal to the autograd graph on CPU, tests/unit/test_plan_distillation.py),
L = 4 b s v / T bytes, one fp32 logits tensor:
  T = 1, `kd_loss`                 log_softmax(student / T) (L), softmax(teacher / T) (L: `kl_div`'s
                                   target * input saves the target), 5 float64/int64 scalars
  T > 1, `vocab_parallel_kd_loss`  softmax(student / T) - softmax(teacher / T) on the shard (L), 4 scalars
Forward temporaries beyond them (torch frees each when its last reference goes): the teacher's fp32 logits are held
through the loss; T = 1: `kl_div` (xlogy(q, q) - q * log p) makes 3 L at once; T > 1: student / T, teacher / T,
exp(teacher'), their difference and its product with exp(teacher') make 5 L at once. Before the loss, the teacher's
head makes its logits in the training precision beside their fp32 copy, and each of its layers a no-grad working set.

A mixture-of-experts teacher (T = 1) is DeepSpeed's MoE layers on the student's expert-parallel groups (E ranks): a
rank holds its dense parts, each MoE layer's gate and experts / E of its experts (PR-MoE's residual MLP whole, as the
student's memory model counts them: `shapes.gpt_spec_params`); its forward prices each MoE layer as the student's
(`layer_times` with its expert count: the gate, the E x C padded slots, the two all-to-alls over E ranks), forward
only; a MoE layer's no-grad working set (`moe_costs.forward_working_set`) is one of the transients.
"""

from __future__ import annotations

from megatron_ds.config import ModelConfig
from megatron_ds.estimate.communication import Links
from megatron_ds.estimate.compute import model_flops_per_iteration
from megatron_ds.estimate.efficiency import Kernels
from megatron_ds.estimate.layer_time import head_forward, layer_times, pre_times
from megatron_ds.estimate.moe_costs import forward_working_set
from megatron_ds.estimate.run_features import RunFeatures
from megatron_ds.model import naming, shapes

FP32 = 4
SCALAR_BYTES = 8
"""The float64 / int64 scalars autograd keeps for the loss's divisions and products."""
KD_LOSS_BYTES = {1: (76, 28), 2: (104, 8)}
"""Bytes per fp32 logit element of the kd loss's memory-bound kernels, (forward, backward), keyed by whether T = 1
(`kd_loss`: / T, log_softmax's max, sum and write, / T, softmax likewise, xlogy, the product, the difference, the
sum: 19 fp32 passes; backward: the product's and log_softmax's gradients, 7) or T > 1 (`vocab_parallel_kd_loss`:
two divisions, two maxima, two exponents, two sums, the difference, its product, its sum, two in-place divisions
and the in-place difference: 26 passes; backward: one scaled copy, 2)."""


def logits_bytes(model: ModelConfig, micro_batch_size: int, tp: int) -> float:
    """L: one fp32 logits tensor of a micro-batch on one tensor rank (b, s, v/T)."""
    return FP32 * micro_batch_size * model.seq_length * model.vocab_size / tp


def teacher_params(teacher: ModelConfig, tp: int, ep: int = 1) -> int:
    """The teacher's parameters on one rank of tensor size `tp` and expert-parallel size `ep` (experts / `ep` of each
    MoE layer; the tied head is its word embedding: counted once)."""
    names = naming.gpt_spec_groups(teacher).names
    params = shapes.gpt_spec_params(teacher, tp, ep)
    return sum(p.num_params for name, p in zip(names, params) if name != naming.TIED_LM_HEAD)


def teacher_weight_bytes(teacher: ModelConfig, tp: int, w: int, ep: int = 1) -> float:
    """Its weights on one rank in the training precision (`w` bytes each)."""
    return teacher_params(teacher, tp, ep) * w


def kd_loss_terms(model: ModelConfig, micro_batch_size: int, tp: int) -> dict[str, float]:
    """Bytes the kd loss saves for the student's backward, one micro-batch on one rank (the module docstring)."""
    logits = logits_bytes(model, micro_batch_size, tp)
    if tp == 1:
        return {
            "kd student log-probabilities (fp32)": logits,
            "kd teacher probabilities (fp32)": logits,
            "kd loss scalars": 5 * SCALAR_BYTES,
        }
    return {"kd softmax difference (fp32)": logits, "kd loss scalars": 4 * SCALAR_BYTES}


def forward_transient(teacher: ModelConfig, micro_batch_size: int, tp: int, w: int, ep: int = 1) -> tuple[float, str]:
    """The largest short-lived set of the teacher's forward and the kd loss beyond the micro-batch's saved activations
    (the kd loss's saved terms included: the moments before the loss subtract them), and what it is; `ep` the
    expert-parallel size a mixture-of-experts teacher's layers run at."""
    logits = logits_bytes(teacher, micro_batch_size, tp)
    saved = sum(kd_loss_terms(teacher, micro_batch_size, tp).values())
    tokens = micro_batch_size * teacher.seq_length
    layer = tokens * w * (2 * teacher.hidden_size + (teacher.fc1_rows + teacher.ffn_hidden_size) / tp)
    head = logits + (logits * w / FP32 if w < FP32 else 0.0)
    options = [
        (
            logits * (4 if tp == 1 else 6),
            "the kd loss of one micro-batch: the teacher's fp32 logits and the loss's temporaries",
        ),
        (head - saved, "the teacher's head: its logits in the training precision and their fp32 copy"),
    ]
    counts = set(teacher.experts_per_layer)
    if 1 in counts:
        options.append((layer - saved, "one teacher layer's no-grad working set"))
    options += [
        (
            forward_working_set(teacher, micro_batch_size, n, ep, w) - saved,
            "one teacher MoE layer's no-grad working set",
        )
        for n in sorted(counts - {1})
    ]
    return max(options, key=lambda o: o[0])


def forward_flops(teacher: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of the teacher's forward over `tokens` tokens (a third of its model FLOPs per iteration)."""
    return model_flops_per_iteration(teacher, tokens // teacher.seq_length) / 3


def step_times(
    teacher: ModelConfig,
    micro_batch_size: int,
    tp: int,
    w: int,
    kernels: Kernels,
    links: Links,
    features: RunFeatures,
    all_to_all: tuple[int, bool] = (1, True),
) -> tuple[float, float, dict[str, float]]:
    """(forward, backward, parts) seconds knowledge distillation adds to one micro-batch: the teacher's forward (the
    same layer-time model, forward only, 1/T of every matmul with its tensor-parallel all-reduces; a MoE layer with
    its expert count and its two all-to-alls over `all_to_all` (E, within a node), part "teacher all-to-all"; its
    embedding and head), the kd loss's memory-bound kernels (`KD_LOSS_BYTES`) and, at T > 1, its two all-reduces of
    per-token maxima (2 b s fp32) and sums (3 b s fp32) over the tensor group."""
    kinds = {
        n: layer_times(
            teacher, micro_batch_size, tp, w, kernels, links, features, attention_dropout=False, num_experts=n,
            all_to_all=all_to_all,
        )
        for n in set(teacher.experts_per_layer)
    }  # fmt: skip
    counts = {n: teacher.experts_per_layer.count(n) for n in kinds}
    layers = sum(kinds[n].forward * c for n, c in counts.items())
    exchange = sum(kinds[n].parts.get("all-to-all", 0.0) / 2 * c for n, c in counts.items())  # the forward's half
    ends = pre_times(teacher, micro_batch_size, tp, w, kernels, links).forward
    ends += head_forward(teacher, micro_batch_size, tp, w, kernels)
    elements = micro_batch_size * teacher.seq_length * teacher.vocab_size / tp
    loss_f, loss_b = KD_LOSS_BYTES[1 if tp == 1 else 2]
    tokens = micro_batch_size * teacher.seq_length
    reduces = 0.0
    if tp > 1:
        reduces = links.all_reduce(2 * FP32 * tokens, tp, True) + links.all_reduce(3 * FP32 * tokens, tp, True)
    loss = kernels.memory(loss_f * elements) + reduces
    parts = {"teacher forward": layers - exchange + ends, "kd loss": loss + kernels.memory(loss_b * elements)}
    if exchange:
        parts["teacher all-to-all"] = exchange
    return layers + ends + loss, kernels.memory(loss_b * elements), parts
