"""`sparse-attention`: when block-sparse attention helps at this sequence length, the patterns,
and whether DeepSpeed's implementation can run here.

Facts: DeepSpeed Sparse Attention (deepspeed/ops/sparse_attention, sparsity_config.py) offered the
fixed, variable, bigbird and bslongformer patterns; its op required torch >= 1.5 and < 2.0 and
triton 1.0.0 (op_builder/sparse_attn.py `is_compatible`, in the versions that had it). The
installed DeepSpeed rejects a `sparse_attention` block: "DeepSpeed Sparse Attention has been
removed" (deepspeed/runtime/config.py `_REMOVED_TOP_LEVEL_CONFIG_KEYS`).

Compute share of attention (estimate): a layer's forward does 24bsh^2 FLOPs in its matrices and
4bs^2h in QK^T and attention x V (Narayanan et al. 2021, Sec. 5.1 / Appendix), so attention's
share is s / (6h + s).
"""

from __future__ import annotations

import json
from importlib import metadata

from megatron_ds.config import ModelConfig
from megatron_ds.estimate.compute import ComputeInputs, core_attention_forward, spec_flops
from megatron_ds.plan.context import Context
from megatron_ds.plan.report import Section
from megatron_ds.units import format_bytes

BLOCK = 16
PATTERNS = {
    "fixed": (
        "local windows plus a few global summary blocks per window (Sparse Transformers, Child et al. 2019); "
        "supports unidirectional attention, so it suits GPT",
        {
            "mode": "fixed",
            "block": BLOCK,
            "different_layout_per_head": True,
            "num_local_blocks": 4,
            "num_global_blocks": 1,
            "attention": "unidirectional",
            "horizontal_global_attention": False,
            "num_different_global_patterns": 4,
        },
    ),
    "variable": (
        "fixed's generalisation: random blocks, windows of different sizes, chosen global blocks",
        {
            "mode": "variable",
            "block": BLOCK,
            "different_layout_per_head": False,
            "num_random_blocks": 0,
            "local_window_blocks": [4],
            "global_block_indices": [0],
            "global_block_end_indices": None,
            "attention": "unidirectional",
            "horizontal_global_attention": False,
        },
    ),
    "bigbird": (
        "random + sliding window + global blocks (BigBird, Zaheer et al. 2020); designed for bidirectional encoders",
        {
            "mode": "bigbird",
            "block": BLOCK,
            "different_layout_per_head": False,
            "num_random_blocks": 1,
            "num_sliding_window_blocks": 3,
            "num_global_blocks": 1,
            "attention": "bidirectional",
        },
    ),
    "bslongformer": (
        "block-sparse Longformer: sliding window + chosen global blocks (Beltagy et al. 2020); "
        "for long-document encoders",
        {
            "mode": "bslongformer",
            "block": BLOCK,
            "different_layout_per_head": False,
            "num_sliding_window_blocks": 3,
            "global_block_indices": [0],
            "global_block_end_indices": None,
            "attention": "bidirectional",
        },
    ),
}
REMOVED_MESSAGE = (
    "DeepSpeed Sparse Attention has been removed; the 'sparse_attention' configuration block is no longer supported."
)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _major_minor(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    parts = [int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit()]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def attention_share(model: ModelConfig) -> float:
    """The core attention's share (scores, softmax, attention over values) of one transformer layer's forward FLOPs,
    by the compute model: GQA, SwiGLU, the head size (`--kv-channels`) and the FFN width counted. For a GPT layer
    it is 4bs^2h of 24bsh^2 + 4bs^2h (Narayanan et al. 2021): s / (6h + s)."""
    body = next(sp for sp in spec_flops(ComputeInputs(model, micro_batch_size=1)) if sp.group == "body")
    return core_attention_forward(body) / body.forward


def sparse_attention_section(ctx: Context) -> Section:
    res = ctx.res
    sec = Section("sparse-attention", "Sparse attention")
    s, h, a = res.dims["seq_length"], res.dims["hidden_size"], res.dims["num_attention_heads"]
    share = attention_share(res.model())
    dense = a * s * s * 2  # one 16-bit score matrix per sample per layer if it were stored
    sec.add(
        f"Sequence {s}, hidden {h}: attention is about {share:.0%} of a layer's forward FLOPs (estimate: the core "
        f"attention's share in megatron_ds/estimate/compute.py; for a GPT layer 4bs^2h of 24bsh^2 + 4bs^2h, Narayanan "
        f"et al. 2021). Block-sparse attention keeping a fraction f of the blocks cuts that part to f; for a GPT layer "
        f"it matters once s approaches 6h = {6 * h} tokens.",
        f"Memory: pretrain_gpt.py uses torch SDPA, whose flash/memory-efficient kernels never store the "
        f"{format_bytes(dense)} score matrix per sample and layer (16-bit, a x s x s), so sparse attention would "
        f"save compute, not activation memory, here.",
    )
    sec.add(
        "Patterns (DeepSpeed's sparsity configs; GPT is unidirectional):",
        *(f"  {name}: {text}" for name, (text, _) in PATTERNS.items()),
    )
    ds, torch_text = _version("deepspeed"), _version("torch")
    torch = _major_minor(torch_text)
    sec.add(
        f"Can it run here? No: the installed DeepSpeed {ds or '(not found)'} "
        f'rejects the block ("{REMOVED_MESSAGE}"), and the op itself needed torch >= 1.5 and < 2.0 with '
        f"triton 1.0.0, while torch here is {torch_text or '(not found)'}.",
        "Alternatives on this torch: keep SDPA (flash attention: exact, O(s) memory); a sliding window is "
        "Megatron-LM's --window-size LEFT,0 (built: query chunks over the band); for global-token patterns use "
        "torch.nn.attention.flex_attention with a block mask"
        + (
            " (available from torch 2.5; this torch qualifies)"
            if torch and torch >= (2, 5)
            else " (needs torch >= 2.5)"
        )
        + "; TransformerLayer would need that change, pretrain_gpt.py has no flag "
        "for it today.",
    )
    for name, (_, block) in PATTERNS.items():
        sec.snippets[
            f"sparse_attention {name} (DeepSpeed versions before its removal; rejected by the installed one)"
        ] = json.dumps({"sparse_attention": block}, indent=2)
    sec.data = {"attention_flop_share": share, "deepspeed_supports": False, "torch": torch_text}
    sec.check(
        False,
        "DeepSpeed sparse attention runs with the installed DeepSpeed and torch: no (removed; needed torch < 2.0)",
        blocking=False,
    )
    return sec
