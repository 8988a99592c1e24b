"""`onebit`: whether 1-bit Adam / 0/1 Adam / 1-bit LAMB fit this model and cluster.

Facts from DeepSpeed's tutorials (deepspeed.ai/tutorials/onebit-adam, zero-one-adam, onebit-lamb):
up to 5x less communication volume for 1-bit Adam (up to 3.4x faster on communication-constrained
clusters), up to 26x for 0/1 Adam on BERT-large, up to 4.6x for 1-bit LAMB; the NCCL backend needs
PyTorch >= 1.8 (NCCL >= 2.8.3 at 64+ GPUs); the MPI backend does not work with pipeline
parallelism; convergence was verified with fp16 mixed precision; frequent checkpoint loading can
hurt convergence. DeepSpeed asserts that 1-bit optimizers are not used with ZeRO (PR #1169).
The fixed paragraphs are `guides/onebit.txt`.
"""

from __future__ import annotations

import importlib.util
import json
import os

from megatron_ds.plan.context import Context
from megatron_ds.plan.report import Section, guide

EXAMPLE_FREEZE_STEP = 1000  # the value in DeepSpeed's config-json examples; tune it (see the text)
ONEBIT_FILES = ("runtime/fp16/onebit/adam.py", "runtime/fp16/onebit/zoadam.py", "runtime/fp16/onebit/lamb.py")


def installed_onebit() -> bool | None:
    """Whether the installed DeepSpeed ships the 1-bit optimizers (None: DeepSpeed not found). No import."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    return all(os.path.exists(os.path.join(root, f)) for f in ONEBIT_FILES)


def snippets(lr: float, freeze_step: int) -> dict[str, str]:
    """Optimizer blocks for DeepSpeed versions that ship these optimizers (text, not for the installed one)."""
    common = {
        "lr": lr,
        "weight_decay": 0.01,
        "bias_correction": False,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    blocks = {
        "OneBitAdam": {**common, "freeze_step": freeze_step},
        "ZeroOneAdam": {
            **common,
            "var_freeze_step": freeze_step,
            "var_update_scaler": 16,
            "local_step_scaler": 32678,
            "local_step_clipper": 16,
        },
        "OneBitLamb": {
            **common,
            "max_coeff": 0.3,
            "min_coeff": 0.01,
            "freeze_step": freeze_step,
            "coeff_beta": 0.9,
            "factor_max": 4.0,
            "factor_min": 0.5,
            "factor_threshold": 0.1,
        },
    }
    return {
        f"{name} (DeepSpeed versions that ship it)": json.dumps({"optimizer": {"type": name, "params": p}}, indent=2)
        for name, p in blocks.items()
    }


def onebit_section(ctx: Context) -> Section:
    res = ctx.res
    sec = Section("onebit", "1-bit Adam / 0/1 Adam / 1-bit LAMB")
    shipped = installed_onebit()
    nodes, link = res.num_nodes, res.raw.interconnect
    prose = guide("onebit")
    sec.add(prose["what"])
    verdict = _verdict(nodes, link, ctx)
    sec.add(f"Fit for this cluster: {verdict}")
    sec.add(
        "Blockers for pretrain_gpt.py:",
        f"  - the installed DeepSpeed {'ships' if shipped else 'does not ship' if shipped is False else '(not found)'} "
        f"them (looked for deepspeed/{ONEBIT_FILES[0]}); a OneBitAdam block would pass its config parser and "
        f"fail when the engine builds the optimizer.",
        *(f"  - {prose[key]}" for key in ("zero", "client-optimizer", "backend")),
        prose["tuning"],
    )
    for name, text in snippets(res.lr or 1e-4, EXAMPLE_FREEZE_STEP).items():
        sec.snippets[name] = text
    sec.data = {"installed": shipped, "verdict": verdict}
    sec.check(
        False if shipped is False else None,
        "1-bit optimizers available in the installed DeepSpeed"
        if shipped is not False
        else "1-bit optimizers are not in the installed DeepSpeed: the snippets are for versions that ship them",
        blocking=False,
    )
    if link is None:
        sec.check(None, "interconnect not given (--interconnect infiniband|ethernet|nvlink): benefit not judged")
    return sec


def _verdict(nodes: int | None, link: str | None, ctx: Context) -> str:
    if nodes is None:
        return "unknown: give --num-gpus and --gpus-per-node."
    if nodes <= 1:
        return "poor: one node communicates over NVLink/PCIe inside the box; compressed all-reduce helps little there."
    if link == "ethernet":
        return (
            f"good in principle: {nodes} nodes over Ethernet are communication-bound, where the tutorial reports "
            f"its largest speed-ups."
        )
    if link in ("infiniband", "nvlink"):
        return (
            f"modest: {nodes} nodes with {link}; gains shrink as bandwidth grows, and with pipeline parallelism "
            f"only the data-parallel gradient traffic is compressed."
        )
    return f"{nodes} nodes: depends on the interconnect (give --interconnect)."
