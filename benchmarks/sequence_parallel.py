#!/usr/bin/env python
"""Per-layer activation memory and measured compute overhead of sequence parallelism, selective and full
recomputation and DeepSpeed-Ulysses, on one transformer layer, on 2 CPU ranks (gloo, fp32).

For each option one TransformerLayer (model/transformer.py, with the tensor-parallel, sequence-parallel or
Ulysses wiring of a real run) takes one micro-batch:

- activations: what its autograd graph keeps for backward (`testing/saved_tensors.graph_bytes`, DeepSpeed's
  checkpoint inputs included), next to the memory model's terms (`estimate/activation_memory.py`) and, as a
  ratio to the T=1 layer, Korthikanti et al.'s closed forms (16-bit, bool masks, no norm statistics:
  sbh(34 + 5as/h) at T=1, sbh(10 + 24/t + 5as/(ht)), sbh/t (34 + 5as/h) with sequence parallelism, the 5as/h
  term dropped by selective recomputation; full recomputation keeps the layer's input, 2sbh);
- compute: the median wall time of forward + backward over `--repeats` runs (after one warm-up), and its
  overhead over the same split without recomputation (the compute model's prediction beside it: the
  recomputed FLOPs over forward + backward, `estimate/compute.py`). At T = 2 and under Ulysses the time
  includes gloo's collectives on the 2 shared cores; compare recomputation within a split.

    OMP_NUM_THREADS=1 python benchmarks/sequence_parallel.py            # the table (~2 minutes on 2 cores)
    python benchmarks/sequence_parallel.py --json rows.json --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024, seq_length=1024,
             max_position_embeddings=1024, vocab_size=128)  # fmt: skip
MICRO_BATCH = 1
DROPOUT = 0.1  # attention dropout on: torch's CPU SDPA takes the math path, which stores the s x s scores
OPTIONS = {
    # name: (split kind, tensor-parallel size, sequence parallel, Ulysses degree, recompute)
    "T=1": ("none", 1, False, 1, "none"),
    "T=1 selective": ("none", 1, False, 1, "selective"),
    "T=1 full": ("none", 1, False, 1, "full"),
    "T=2": ("tensor", 2, False, 1, "none"),
    "T=2 selective": ("tensor", 2, False, 1, "selective"),
    "T=2 SP": ("tensor", 2, True, 1, "none"),
    "T=2 SP selective": ("tensor", 2, True, 1, "selective"),
    "T=2 SP full": ("tensor", 2, True, 1, "full"),
    "Ulysses N=2": ("ulysses", 1, False, 2, "none"),
    "Ulysses N=2 selective": ("ulysses", 1, False, 2, "selective"),
}


def _layer(kind: str, t: int, sp: bool, n: int, recompute: str) -> tuple[Any, tuple[int, ...]]:
    import torch.distributed as dist

    from megatron_ds.config import Config, ModelConfig, ParallelConfig, RegularizationConfig
    from megatron_ds.model import tensor_parallel
    from megatron_ds.model.gpt_pipe import build_topology
    from megatron_ds.model.tensor_parallel_rank import NO_TENSOR_PARALLEL, NO_ULYSSES, UlyssesGroup
    from megatron_ds.model.transformer import TransformerLayer

    m = ModelConfig(**MODEL)
    reg = RegularizationConfig(hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
    tp, ul = NO_TENSOR_PARALLEL, NO_ULYSSES
    s, b, h = m.seq_length, MICRO_BATCH, m.hidden_size
    shape: tuple[int, ...] = (b, s, h)
    if kind == "tensor":
        cfg = Config(model=m, regularization=reg, parallel=ParallelConfig(tensor_model_parallel_size=t, world_size=t,
                                                                          sequence_parallel=sp))  # fmt: skip
        tp = tensor_parallel.setup(cfg, build_topology(cfg))
        shape = (s // t, b, h) if sp else shape
    elif kind == "ulysses":
        ul = UlyssesGroup(size=n, rank=dist.get_rank(), group=dist.group.WORLD)
        shape = (b, s // n, h)
    layer = TransformerLayer(m, reg, 1, tp, ul, selective_recompute=recompute == "selective").train()
    return layer, shape


def _run(layer: Any, x: Any, full: bool) -> Any:
    if not full:
        return layer(x)
    from deepspeed.runtime.activation_checkpointing import checkpointing

    return checkpointing.checkpoint(layer, x)


def measure(name: str, repeats: int) -> dict[str, Any]:
    """One option on this rank: graph bytes, model bytes, median forward + backward seconds."""
    import torch
    import torch.distributed as dist

    from megatron_ds.config import ModelConfig, RegularizationConfig
    from megatron_ds.estimate import activation_memory as act
    from megatron_ds.estimate import compute
    from megatron_ds.estimate.activation_kernels import Split, kernels
    from megatron_ds.testing.saved_tensors import graph_bytes

    kind, t, sp, n, recompute = OPTIONS[name]
    layer, shape = _layer(kind, t, sp, n, recompute)
    x = torch.randn(*shape, requires_grad=True)
    y = _run(layer, x, recompute == "full")
    saved = graph_bytes(y, layer.parameters())
    del y
    times = []
    for _i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        out = _run(layer, x, recompute == "full")
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
        x.grad = None
        layer.zero_grad(set_to_none=True)
    m, reg = ModelConfig(**MODEL), RegularizationConfig(hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
    k = kernels("fp32", "cpu", DROPOUT)
    split = Split(t, sp, n, selective=recompute == "selective")
    model = (
        act.checkpointed_layer_bytes(m, MICRO_BATCH, k, split)
        if recompute == "full"
        else sum(act.transformer_layer_terms(m, MICRO_BATCH, k, split, regularization=reg).values())
    )
    flops = compute.spec_flops(compute.ComputeInputs(m, MICRO_BATCH, t, ulysses_size=n))
    body = next(sp_ for sp_ in flops if sp_.group == "body")
    again = {"none": 0, "selective": compute.core_attention_forward(body), "full": body.forward}[recompute]
    return {"option": name, "saved": saved, "model": model, "seconds": statistics.median(times[1:]),
            "predicted_overhead": again / (body.forward + body.backward)}  # fmt: skip


def korthikanti(name: str) -> float:
    """The paper's per-layer bytes of this option (16-bit assumptions), for the ratios."""
    from megatron_ds.estimate import activation_memory as act

    kind, t, sp, n, recompute = OPTIONS[name]
    s, h, a = MODEL["seq_length"], MODEL["hidden_size"], MODEL["num_attention_heads"]
    if recompute == "full":
        return 2 * s * MICRO_BATCH * h / (t if sp else 1)
    if kind == "ulysses":
        return act.korthikanti_layer_bytes(s, MICRO_BATCH, h, a, 1, False, recompute == "selective") / n
    return act.korthikanti_layer_bytes(s, MICRO_BATCH, h, a, t, sp, recompute == "selective")


def worker(out: str, repeats: int) -> None:
    import torch.distributed as dist

    from megatron_ds.config import ParallelConfig
    from megatron_ds.distributed import init_distributed, shutdown_distributed

    init_distributed(ParallelConfig(world_size=2))
    rows = [measure(name, repeats) for name in OPTIONS]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    shutdown_distributed()


def table(rows: list[dict[str, Any]]) -> str:
    mib = 2.0**20
    base = {r["option"]: r for r in rows}
    lines = [
        f"one layer, h={MODEL['hidden_size']} a={MODEL['num_attention_heads']} s={MODEL['seq_length']} "
        f"b={MICRO_BATCH}, fp32, dropout {DROPOUT} (math attention), per rank of 2 CPU ranks (gloo)",
        f"{'option':<22} {'saved MiB':>9} {'model MiB':>9} {'x T=1':>6} {'Korthikanti x T=1':>17} "
        f"{'fwd+bwd ms':>10} {'overhead':>8} {'predicted':>9}",
    ]
    for r in rows:
        kind, t, sp, n, recompute = OPTIONS[r["option"]]
        plain = next(
            x for x in rows if OPTIONS[x["option"]][:4] == (kind, t, sp, n) and OPTIONS[x["option"]][4] == "none"
        )
        overhead = r["seconds"] / plain["seconds"] - 1
        lines.append(
            f"{r['option']:<22} {r['saved'] / mib:>9.2f} {r['model'] / mib:>9.2f} "
            f"{r['saved'] / base['T=1']['saved']:>6.3f} {korthikanti(r['option']) / korthikanti('T=1'):>17.3f} "
            f"{1000 * r['seconds']:>10.1f} {overhead:>+8.1%} {r['predicted_overhead']:>+9.1%}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--render", help="print the table of rows written earlier with --json, no run")
    args = ap.parse_args()
    if args.render:
        print(table(json.loads(Path(args.render).read_text())))
        return 0
    import tempfile

    from megatron_ds.testing.launch import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        run_ranks([__file__, "--worker", out, str(args.repeats)], 2, timeout=1800, cwd=str(ROOT))
        rows = json.loads(Path(out).read_text())
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        from megatron_ds.distributed import run_and_exit

        run_and_exit(worker, sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
