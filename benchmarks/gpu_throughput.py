#!/usr/bin/env python
"""Throughput of a ~1B GPT under several pipeline layouts: tokens/s, TFLOP/s per GPU and MFU.

Runs `pretrain_gpt.py` once per layout with `torchrun`, one rank per GPU, `--mock-data`, and reads
what its log line prints (`training/logger.py`: Megatron-LM's `throughput per GPU (TFLOP/s/GPU)`
from `estimate.compute.model_flops_per_iteration`, MFU against `estimate/devices.py` or
`--peak-tflops`). The figure of a layout is the median over the log windows after the first (the
first holds start-up and the memory report's profiled steps).

    # one GPU (P=1: the layouts coincide, only `stock` is run)
    python benchmarks/gpu_throughput.py
    # 8 GPUs of one node, the pipeline over all of them
    python benchmarks/gpu_throughput.py --gpus 8 --pipeline-model-parallel-size 8
    # the CPU smoke test (tests/e2e/test_gpu_throughput_script.py): a tiny model on 2 gloo ranks
    python benchmarks/gpu_throughput.py --cpu --model tiny --gpus 2 --pipeline-model-parallel-size 2

Beside each measurement it prints the planner's prediction for the same model, degrees, micro-batch,
layout and device (`plan.search.evaluate`, the step-time model of `estimate/step_time.py` with
pretrain_gpt.py's run features; pure, no GPU needed) and measured / predicted, when the device is in
`estimate/devices.py` (`--gpu NAME` names it; a CPU run has none). The `h100-1.7b` model is the
smallest of the Megatron-LM README's H100 table (the record `planner_vs_published.py` finds 40% too
fast): on one H100 it measures the same shape's compute with our own kernels.

Layouts: `stock` (DeepSpeed's type:transformer), `both` (--pp-dedicated-embedding-stages both,
P >= 3), `memory`, `fastest` (the memory limit is the GPU's memory unless --pp-memory-limit is
given). One rank per GPU: ranks sharing a GPU are not attempted (NCCL refuses two ranks of one
communicator on one device). The model sizes: `1b` is GPT-3 1.3B's shape (24 layers, hidden 2048,
16 heads) with sequence 2048 and the GPT-2 vocabulary, 1.3 B parameters.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "1b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --vocab-size 50257",
    "tiny": "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 512",
    "h100-1.7b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --vocab-size 131072 "
    "--untie-embeddings-and-output-weights",
}
METHODS = {"stock": "none", "both": "both", "memory": "memory", "fastest": "fastest"}
"""The planner's `--layout` of each layout."""
LAYOUTS = {
    "stock": [],
    "both": ["--pp-dedicated-embedding-stages", "both"],
    "memory": ["--pp-partition-method", "memory"],
    "fastest": ["--pp-partition-method", "fastest"],
}
LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \| .*elapsed time per iteration \(ms\): ([\d.]+) \| throughput per GPU "
    r"\(TFLOP/s/GPU\): ([\d.e+-]+) \|(?: MFU: ([\d.]+)% \|)?.*tokens per second: ([\d.]+)"
)
LAYOUT = re.compile(r"transformer layers per stage: [\d ]+ \(layout (\S+), method")


def command(args: argparse.Namespace, layout: str) -> list[str]:
    flags = [
        *MODELS[args.model].split(),
        *LAYOUTS[layout],
        "--pipeline-model-parallel-size",
        str(args.pipeline_model_parallel_size),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--global-batch-size",
        str(args.global_batch_size),
        "--train-iters",
        str(args.iters),
        "--log-interval",
        str(args.log_interval),
        "--zero-stage",
        str(args.zero_stage),
        "--mock-data",
        "--eval-iters",
        "0",
        "--lr",
        "1e-4",
        "--num-workers",
        "0",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--no-log-memory",
    ]
    if args.precision != "fp32":
        flags.append(f"--{args.precision}")
    if args.checkpoint_activations:
        flags.append("--checkpoint-activations")
    if layout == "fastest" and args.pp_memory_limit:
        flags += ["--pp-memory-limit", args.pp_memory_limit]
    if args.peak_tflops:
        flags += ["--peak-tflops", str(args.peak_tflops)]
    return flags


def run(args: argparse.Namespace, layout: str) -> dict:
    """One pretrain_gpt.py run; the medians of its log windows after the first."""
    from megatron_ds.testing.launch import run_torchrun

    flags = command(args, layout)
    out = run_torchrun(args.gpus, [str(ROOT / "pretrain_gpt.py"), *flags], timeout=args.timeout, cwd=str(ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"{layout}: pretrain_gpt.py exited {out.returncode}:\n{out.stdout[-4000:]}")
    windows = [m for m in LINE.finditer(out.stdout)][1:]
    if not windows:
        raise RuntimeError(f"{layout}: fewer than two log lines; raise --iters:\n{out.stdout[-4000:]}")
    mfus = [float(m.group(4)) for m in windows if m.group(4) is not None]
    return {
        "layout": layout,
        "string": LAYOUT.search(out.stdout).group(1),
        "step_ms": statistics.median(float(m.group(2)) for m in windows),
        "tflops": statistics.median(float(m.group(3)) for m in windows),
        "mfu": statistics.median(mfus) if mfus else None,
        "tokens_per_s": statistics.median(float(m.group(5)) for m in windows),
        "command": f"torchrun --nproc_per_node {args.gpus} pretrain_gpt.py " + " ".join(flags),
    }


def model_inputs(model: str) -> tuple[dict[str, int], list[str]]:
    """A MODELS entry as the planner's inputs: its sizes (`--num-layers 24` -> num_layers=24) and its
    architecture flags (those without a value)."""
    words = MODELS[model].split()
    sizes, flags = {}, []
    for i, word in enumerate(words):
        value = words[i + 1] if i + 1 < len(words) else "--"
        if word.startswith("--") and not value.startswith("--"):
            sizes[word[2:].replace("-", "_")] = int(value)
        elif word.startswith("--"):
            flags.append(word)
    return sizes, flags


def predict(args: argparse.Namespace, layout: str, gpu: str | None) -> dict | None:
    """The planner's predicted step and model TFLOP/s per GPU for this run on `gpu` (a table name), or None
    when there is no device to price (a CPU run) or the layout cannot be built."""
    if gpu is None:
        return None
    from megatron_ds.pipeline.layout import LayoutError
    from megatron_ds.plan import search
    from megatron_ds.plan.hardware import PlanError
    from megatron_ds.plan.inputs import PlanInputs, resolve

    dims, arch = model_inputs(args.model)
    p = args.pipeline_model_parallel_size
    raw = PlanInputs(
        **dims,
        architecture=arch or None,
        num_gpus=args.gpus,
        gpus_per_node=args.gpus,
        gpu=gpu,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        zero_stage=args.zero_stage,
        precision=args.precision,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=p,
        layout=METHODS[layout],
    )
    try:
        res = resolve(raw)
        ckpt = args.checkpoint_activations
        cand = search.evaluate(res, 1, p, args.micro_batch_size, args.zero_stage, args.precision, ckpt, METHODS[layout])
    except (PlanError, LayoutError) as e:
        print(f"  no prediction for {layout}: {e}", file=sys.stderr)
        return None
    return {"tflops": cand.time.tflops_per_gpu, "step_ms": cand.seconds * 1e3, "string": cand.layout.to_string()}


def device_name(args: argparse.Namespace) -> str | None:
    """The planner's name of the GPU the runs use (`--gpu`, else the visible GPU's), None on CPU or off the table."""
    if args.cpu:
        return None  # a CPU smoke run is not priced as a GPU
    if args.gpu:
        return args.gpu
    import torch

    from megatron_ds.estimate.devices import find_device

    found = find_device(torch.cuda.get_device_name(0))
    return found.name if found else None


def format_table(results: list[dict], args: argparse.Namespace) -> str:
    head = (
        f"{'layout':<8} {'tokens/s':>10} {'TFLOP/s/GPU':>12} {'MFU':>6} {'step ms':>9} {'predicted':>9} "
        f"{'meas/pred':>9}  layout string"
    )
    lines = [
        f"model {args.model}: {MODELS[args.model]}; {args.gpus} rank(s), P={args.pipeline_model_parallel_size}, "
        f"micro-batch {args.micro_batch_size}, global batch {args.global_batch_size}, {args.precision}, "
        f"ZeRO-{args.zero_stage}{', recompute' if args.checkpoint_activations else ''}",
        head,
    ]
    for r in results:
        mfu = f"{r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        tflops = f"{r['tflops']:.1f}" if r["tflops"] >= 10 else f"{r['tflops']:.3g}"
        pred = r.get("predicted")
        predicted, ratio = (f"{pred['tflops']:.1f}", f"{r['tflops'] / pred['tflops']:.3f}") if pred else ("n/a", "n/a")
        if pred and pred["string"] != r["string"]:
            predicted += "*"  # the planner's method split the layers otherwise
        lines.append(
            f"{r['layout']:<8} {r['tokens_per_s']:>10.1f} {tflops:>12} {mfu:>6} {r['step_ms']:>9.1f} {predicted:>9} "
            f"{ratio:>9}  {r['string']}"
        )
    gpu = next((r["gpu"] for r in results if r.get("gpu")), None)
    lines += [
        f"  * predicted for the planner's layout {r['predicted']['string']} of the same method"
        for r in results
        if r.get("predicted") and r["predicted"]["string"] != r["string"]
    ]
    lines.append(
        f"predicted: the planner's model TFLOP/s per GPU for the same run on {gpu} (estimate/step_time.py)"
        if gpu
        else "predicted: n/a (no device of estimate/devices.py to price; give --gpu NAME)"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="1b")
    p.add_argument("--gpus", type=int, help="ranks to start, one per GPU (default: every visible GPU)")
    p.add_argument("--pipeline-model-parallel-size", type=int, help="default: --gpus (no data parallelism)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, help="default: 16 x micro-batch x data-parallel ranks")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), help="default: bf16 on GPU, fp32 with --cpu")
    p.add_argument("--zero-stage", type=int, choices=(0, 1), default=1)
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--pp-memory-limit", help="for `fastest` (default: the GPU's memory; required with --cpu)")
    p.add_argument("--peak-tflops", type=float, help="for MFU when the device is not in estimate/devices.py")
    p.add_argument("--cpu", action="store_true", help="run on CPU ranks (gloo): a smoke test, not a measurement")
    p.add_argument(
        "--gpu", help="the device's name in estimate/devices.py for the prediction (default: the visible GPU's)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = p.parse_args(argv)
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            p.error("no GPU is visible; this script measures GPUs (use --cpu for the smoke test)")
        args.gpus = args.gpus or torch.cuda.device_count()
        if args.gpus > torch.cuda.device_count():
            p.error(f"--gpus {args.gpus} but {torch.cuda.device_count()} GPU(s) visible: one rank per GPU")
    args.gpus = args.gpus or 1
    args.pipeline_model_parallel_size = args.pipeline_model_parallel_size or args.gpus
    if args.gpus % args.pipeline_model_parallel_size:
        p.error("--gpus must be a multiple of --pipeline-model-parallel-size")
    dp = args.gpus // args.pipeline_model_parallel_size
    args.global_batch_size = args.global_batch_size or 16 * args.micro_batch_size * dp
    args.precision = args.precision or ("fp32" if args.cpu else "bf16")
    if args.cpu and "fastest" in args.layouts and not args.pp_memory_limit:
        args.pp_memory_limit = "8GiB"  # CPU has no device memory to default to
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layouts = args.layouts.split(",")
    bad = [name for name in layouts if name not in LAYOUTS]
    if bad:
        sys.exit(f"unknown layout(s) {bad}; choose from {', '.join(LAYOUTS)}")
    p = args.pipeline_model_parallel_size
    if p == 1:
        layouts = ["stock"]  # one stage: every method gives the same layout
    if p < 3:
        layouts = [name for name in layouts if name != "both"]  # needs P >= 3
    results, start, gpu = [], time.time(), device_name(args)
    for layout in layouts:
        results.append({**run(args, layout), "predicted": predict(args, layout, gpu), "gpu": gpu})
        print(f"  ran {layout} ({time.time() - start:.0f} s so far)", file=sys.stderr, flush=True)
    print(format_table(results, args))
    print("commands (from the repository root):")
    for r in results:
        print(f"  {r['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
