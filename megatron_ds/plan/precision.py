"""`precision`: fp16 / bf16 / fp8 by compute capability, with the DeepSpeed snippet and the reason.

Hardware facts: bf16 tensor-core math needs compute capability 8.0 (Ampere) or newer; fp8 tensor
cores exist on 8.9 (Ada Lovelace) and 9.0 (Hopper) and newer, used through NVIDIA Transformer
Engine; fp16 tensor cores exist from 7.0 (Volta). DeepSpeed's config has `fp16`, `bf16` and
`torch_autocast` blocks and no fp8 switch (deepspeed/runtime/config.py, precision_config.py).
The fixed lines are `guides/precision.txt`.
"""

from __future__ import annotations

from importlib import metadata

from megatron_ds.estimate.devices import architecture_of
from megatron_ds.plan.context import Context
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import Resolved
from megatron_ds.plan.report import Section, guide

BF16_MIN_CC = (8, 0)
FP8_MIN_CC = (8, 9)
FP16_TENSOR_CORE_CC = (7, 0)
FP16_SNIPPET = {
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
}
BF16_SNIPPET = {"bf16": {"enabled": True}}


def _cc_text(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]} ({architecture_of(cc)})"


def choose_precision(res: Resolved) -> tuple[str, str]:
    """(precision, one-line reason); a fixed --precision is checked against the hardware."""
    fixed, cc = res.raw.precision, res.cc
    gpu = f"--gpu {res.gpu_name}" if res.gpu_name else "--compute-capability"
    if fixed == "bf16" and cc is not None and cc < BF16_MIN_CC:
        raise PlanError(
            f"--precision bf16 needs compute capability >= 8.0 (Ampere or newer) but {gpu} has "
            f"{_cc_text(cc)}; use --precision fp16"
        )
    if fixed:
        return fixed, "fixed by --precision"
    if cc is None and res.non_nvidia_gpu:
        return "bf16", f"{res.gpu_name}: bf16 matrix units (the GPU table's bf16 peak), no loss scaling"
    if cc is None:
        return "bf16", "compute capability unknown: assumed Ampere or newer (give --gpu or --compute-capability)"
    if cc >= BF16_MIN_CC:
        return "bf16", (
            f"compute capability {_cc_text(cc)} has bf16 tensor cores; bf16 keeps fp32's exponent "
            f"range, so no loss scaling and no skipped steps"
        )
    if cc >= (6, 0):
        return "fp16", (
            f"compute capability {_cc_text(cc)} has no bf16; fp16 with dynamic loss scaling"
            + ("" if cc >= FP16_TENSOR_CORE_CC else " (no tensor cores before 7.0: small speed-up)")
        )
    return "fp32", f"compute capability {_cc_text(cc)}: no fast 16-bit math"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def precision_section(ctx: Context) -> Section:
    res, precision, reason = ctx.res, ctx.precision, ctx.precision_reason
    sec = Section("precision", "Mixed precision")
    cc = res.cc
    sec.add(f"Recommended: {precision} ({reason}).")
    text = guide("precision")
    sec.add(*(f"  {text[p]}" for p in ("fp16", "bf16", "fp8")))
    fp8 = cc is not None and cc >= FP8_MIN_CC
    sec.add(
        f"  fp8 on this GPU: {'hardware-capable' if fp8 else 'not available' if cc else 'unknown'}"
        + (
            "; pretrain_gpt.py builds torch nn.Linear layers, not Transformer Engine modules, so it cannot "
            "train in fp8 today"
            if fp8
            else ""
        )
    )
    if precision == "bf16":
        sec.add(f"  {text['bf16-accumulation']}")
    if precision in ("bf16", "fp16"):
        sec.snippets["deepspeed precision block"] = BF16_SNIPPET if precision == "bf16" else FP16_SNIPPET
        sec.add(f"  pretrain_gpt.py flag: --{precision}")
    ds, torch = _version("deepspeed"), _version("torch")
    sec.data = {"recommended": precision, "reason": reason, "fp8_capable": fp8, "deepspeed": ds, "torch": torch}
    _checks(sec, res, precision, ds, torch)
    return sec


def _checks(sec: Section, res: Resolved, precision: str, ds: str | None, torch: str | None) -> None:
    cc = res.cc
    if cc is None and res.non_nvidia_gpu:
        sec.check(True, f"{precision} on {res.gpu_name}: the GPU table has its {precision} peak")
    elif cc is None:
        sec.check(None, "precision vs hardware: compute capability unknown (give --gpu or --compute-capability)")
    elif precision == "bf16":
        sec.check(cc >= BF16_MIN_CC, f"bf16 needs compute capability >= 8.0: GPU has {_cc_text(cc)}")
    elif precision == "fp16":
        sec.check(cc >= (6, 0), f"fp16 on compute capability {_cc_text(cc)}")
    sec.check(
        ds is not None,
        f"DeepSpeed installed here: {ds or 'not found'} (its config parser accepts the "
        f"block above; checked by tests/unit/test_plan.py)",
    )
    sec.check(
        None if torch is None else True,
        f"torch installed here: {torch or 'not found'}; the versions on your cluster were not inspected",
    )
