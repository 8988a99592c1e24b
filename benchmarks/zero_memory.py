#!/usr/bin/env python
"""Measured per-rank model-state memory of ZeRO-2 and ZeRO-3 (with and without offload) on DeepSpeed's plain
engine, next to the memory model (`estimate/memory_model.py`) and DeepSpeed's own estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`).

Each case trains a GPT of ~13M parameters (two ZeRO-2 offload rows: ~7.5M, a small vocabulary) in bf16
(the estimators' 16-bit mixed precision; two fp32 rows too) on 2 CPU ranks (DP=2, gloo) for two steps;
the second is measured by `--log-memory`'s meter (`training/measure/memory.py`): params (parameter
storages and ZeRO-3 partitions), grads (alive just before the optimizer step), optimizer
(everything else the optimizer holds), and of these what ZeRO's offload keeps in host memory. The device
column is params + grads + optimizer - host. On the model side: `StageMemory.params + grads + optimizer`
(device) and `.host`; DeepSpeed's estimators give the GPU and the CPU bytes per node (buffer factor 1 for
the CPU: the model states themselves). ZeRO-3's GPU estimate adds 4 bytes x the largest layer's parameters
(its working set while gathered), which is not a model state at rest: the table shows it apart.

    python benchmarks/zero_memory.py            # the table (about three minutes on 2 cores)
    python benchmarks/zero_memory.py --json     # the rows as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 2
MODEL = {
    "model__num_layers": 4,
    "model__hidden_size": 384,
    "model__num_attention_heads": 6,
    "model__ffn_hidden_size": 1536,
    "model__vocab_size": 16384,
    "model__seq_length": 32,
    "model__max_position_embeddings": 32,
    "training__precision": "bf16",
    "training__micro_batch_size": 1,
    "training__global_batch_size": 4,
}
SMALL_VOCAB_OFFLOAD = "ZeRO-2 + CPU Adam, vocabulary 1024"
CASES = {
    "ZeRO-2 fp32": {"training__zero_stage": 2, "training__precision": "fp32"},
    "ZeRO-3 fp32": {"training__zero_stage": 3, "training__precision": "fp32"},
    "ZeRO-2": {"training__zero_stage": 2},
    "ZeRO-2 + CPU Adam (offload_optimizer cpu)": {"training__zero_stage": 2, "training__cpu_optimizer": True},
    "ZeRO-3": {"training__zero_stage": 3},
    "ZeRO-3 + offload_optimizer + offload_param cpu": {
        "training__zero_stage": 3,
        "training__cpu_optimizer": True,
        "training__offload_param": "cpu",
    },
    # The word embedding above is half the parameters, and ZeRO-2 offload stages the largest parameter: with
    # vocabulary 1024 the largest is an MLP matrix (1536 x 384), a realistic share of the model.
    SMALL_VOCAB_OFFLOAD: {"training__zero_stage": 2, "training__cpu_optimizer": True, "model__vocab_size": 1024},
    # ... and with one micro-batch per step, DeepSpeed keeps no accumulated 16-bit gradients on the host.
    SMALL_VOCAB_OFFLOAD + ", one micro-batch per step": {
        "training__zero_stage": 2,
        "training__cpu_optimizer": True,
        "model__vocab_size": 1024,
        "training__global_batch_size": 2,
    },
}


def config_for(case: str):
    from megatron_ds.testing.scenario import tiny_config

    return tiny_config(**{**MODEL, **CASES[case]}, parallel__world_size=WORLD)


def worker(case: str, out: str) -> None:
    """One rank: two steps, the second measured; writes its RankMemory as JSON."""
    import dataclasses

    import torch.distributed as dist

    from megatron_ds.distributed import init_distributed, shutdown_distributed
    from megatron_ds.testing.scenario import micro_batches
    from megatron_ds.training.builder import build_pipeline
    from megatron_ds.training.measure.memory import StepMeter

    config = config_for(case)
    init_distributed(config.parallel)
    try:
        pipe = build_pipeline(config)
        meter = StepMeter(pipe.engine)
        dp = pipe.engine.grid.get_data_parallel_rank()
        for step, context in enumerate((meter.warm_up, meter.measure)):
            with context():
                pipe.train_batch(iter(list(micro_batches(config, step, dp))))
        mem = meter.result(dist.get_rank(), 0)
        Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(dataclasses.asdict(mem)))
    finally:
        shutdown_distributed(clean=True)


def predicted(case: str) -> dict[str, float]:
    """The memory model's and DeepSpeed's estimators' bytes for this case."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from megatron_ds.estimate.machine import CPU
    from megatron_ds.estimate.memory_model import stage_memory_for
    from megatron_ds.estimate.run_layout import memory_inputs
    from megatron_ds.model import naming, shapes

    config = config_for(case)
    t = config.training
    stage = stage_memory_for(memory_inputs(config, CPU), 0, 1, config.model.num_layers)
    specs = shapes.gpt_spec_params(config.model, 1)
    names = naming.gpt_spec_groups(config.model).names
    total = sum(sp.num_params for name, sp in zip(names, specs) if name != naming.TIED_LM_HEAD)
    largest = max(sp.largest for sp in specs)
    offload = t.optimizer_offload != "none"
    if t.precision == "fp32":  # DeepSpeed's estimators assume 16-bit mixed precision
        return {
            "model_device": stage.params + stage.grads + stage.optimizer,
            "model_host": stage.host,
            "ds_gpu": None,
            "ds_cpu_per_rank": None,
            "ds_working_set": 0,
            "params": total,
            "vocab": config.model.vocab_size,
        }
    if t.zero_stage == 2:
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, WORLD, 1, offload, additional_buffer_factor=1.0)
        working = 0
    else:
        cpu, gpu, working = estimate_zero3_model_states_mem_needs(
            total, largest, WORLD, 1, offload, t.offload_param != "none", True, additional_buffer_factor=1.0
        )
        gpu -= working
    return {
        "model_device": stage.params + stage.grads + stage.optimizer,
        "model_host": stage.host,
        "ds_gpu": gpu,
        "ds_cpu_per_rank": cpu / WORLD if offload else None,  # without offload: the CPU memory to load the model
        "ds_working_set": working,
        "params": total,
        "vocab": config.model.vocab_size,
    }


def measure(case: str) -> dict[str, float]:
    from megatron_ds.testing.launch import run_ranks

    with tempfile.TemporaryDirectory() as out:
        run_ranks([str(Path(__file__).resolve()), "--worker", case, out], WORLD, timeout=600)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    states = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks)
    host = max(r["host"] for r in ranks)
    return {"measured_device": states - host, "measured_host": host}


def rows() -> list[dict[str, object]]:
    out = []
    for case in CASES:
        row = {"case": case, **predicted(case), **measure(case)}
        out.append(row)
    return out


def _ratio(measured: float, predicted: float | None) -> str:
    if predicted is None or (not predicted and not measured):
        return "-"
    return f"{measured / predicted:.3f}" if predicted else "inf"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2.0**20:.2f}"


def table(data: list[dict[str, object]]) -> str:
    mib = 2.0**20
    sizes = {f"{r['params'] / 1e6:.1f}M parameters (vocabulary {r['vocab']})": None for r in data}  # in order, once
    lines = [
        f"GPT of {' or '.join(sizes)} parameters, bf16 unless fp32, DP={WORLD} "
        "(per rank, MiB; ratio = measured / predicted; DeepSpeed's estimators are for 16-bit training)",
        "| case | measured device | memory model | ratio | DeepSpeed estimator (GPU) | ratio "
        "| measured host | memory model | ratio | DeepSpeed estimator (CPU) | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data:
        lines.append(
            f"| {r['case']} | {r['measured_device'] / mib:.2f} | {r['model_device'] / mib:.2f} | "
            f"{_ratio(r['measured_device'], r['model_device'])} | {_mib(r['ds_gpu'])} | "
            f"{_ratio(r['measured_device'], r['ds_gpu'])} | {r['measured_host'] / mib:.2f} | "
            f"{r['model_host'] / mib:.2f} | {_ratio(r['measured_host'], r['model_host'])} | "
            f"{_mib(r['ds_cpu_per_rank'])} | {_ratio(r['measured_host'], r['ds_cpu_per_rank'])} |"
        )
    working = [r for r in data if r["ds_working_set"]]
    if working:
        lines.append(
            f"ZeRO-3's GPU estimate also adds {working[0]['ds_working_set'] / mib:.2f} MiB (4 x the largest layer) "
            "for the gathered working set: a transient, not in the columns above."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from megatron_ds.distributed import run_and_exit

        run_and_exit(worker, *args.worker)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    data = rows()
    print(json.dumps(data, indent=1) if args.json else table(data))


if __name__ == "__main__":
    main()
