"""Measure this machine's kernel rates (a profile for the step-time model), then check the model here:
predicted vs measured seconds of the models of `benchmarks/stage_memory.py` on this CPU, one thread.

The profile is three micro-benchmarks, none of them a transformer layer, so nothing is fitted to what is
then compared: the best fp32 matmul rate over a few square sizes (the MAMF idea: stas00/ml-engineering's
mamf-finder), the bandwidth of a large copy (bytes read + written), and torch's scaled_dot_product_attention
forward and backward with a causal mask (the flash kernel CPU torch runs without attention dropout;
FLOPs counted as `estimate/layer_time.py` counts them). `--write FILE` stores it for the planner's
`--kernel-profile FILE` (on a GPU the same script measures the GPU: `--device cuda --precision bf16`).

The comparison: `training/measure/calibrate.py` times one micro-batch of each spec group (embeddings, one
transformer layer, the head with the loss) and the optimizer over its parameters in this process (CPU
time); `estimate/layer_time.py` and the optimizer's bytes (`estimate/step_time.py`) predict the same from
the profile alone; per stage of the stock 5-stage layout, M x (forward + backward) + optimizer.

    OMP_NUM_THREADS=1 python benchmarks/kernel_profile.py [--write profile.json] [--models 8-layer 48-layer]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_memory import COMMON, MODELS, NUM_STAGES  # noqa: E402 - the same models

from megatron_ds.estimate.communication import Links  # noqa: E402
from megatron_ds.estimate.efficiency import Kernels  # noqa: E402
from megatron_ds.estimate.layer_time import FLASH_BACKWARD_FLOPS, layer_times, post_times, pre_times  # noqa: E402
from megatron_ds.estimate.run_features import deepspeed_features  # noqa: E402
from megatron_ds.estimate.step_time import ADAM_BYTES_FP32_STATES  # noqa: E402
from megatron_ds.flags.parser import parse_config  # noqa: E402
from megatron_ds.model.shapes import layer_params, position_embedding_params, word_embedding_params  # noqa: E402
from megatron_ds.training.measure.calibrate import calibrate  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _seconds(fn, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def measure(device: str = "cpu", precision: str = "fp32") -> dict:
    dtype = DTYPES[precision]
    best = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        best = max(best, 2 * n**3 / _seconds(lambda a=a, b=b: a @ b))
    x = torch.randn(16 * 2**20, dtype=dtype, device=device)
    y = torch.empty_like(x)
    copy = 2 * x.numel() * x.element_size() / _seconds(lambda: y.copy_(x))
    bh, s, hd = 8, 512, 64
    q, k, v = (torch.randn(1, bh, s, hd, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    attend = torch.nn.functional.scaled_dot_product_attention
    forward = _seconds(lambda: attend(q, k, v, is_causal=True))

    def both() -> None:
        attend(q, k, v, is_causal=True).sum().backward()

    backward = max(_seconds(both) - forward, 1e-9)
    flops = 4.0 * bh * hd * s * (s + 1) / 2
    return {
        "name": f"{device}, {torch.get_num_threads()} thread(s), {precision}",
        "matmul_tflops": best / 1e12,
        "memory_gbs": copy / 1e9,
        "attention_forward_tflops": flops / forward / 1e12,
        "attention_backward_tflops": FLASH_BACKWARD_FLOPS * flops / backward / 1e12,
    }


def predicted(model, mb: int, kernels: Kernels) -> dict[str, tuple[float, float, float]]:
    """(forward, backward, optimizer) seconds per group by the time model."""
    links = Links(1e12, 1e12, 1)  # one process: no communication
    run = deepspeed_features(0, 4)
    layer = layer_times(model, mb, 1, 4, kernels, links, run, attention_dropout=False)
    pre, post = pre_times(model, mb, 1, 4, kernels, links), post_times(model, mb, 1, 4, kernels, links, run)

    def adam(params: int) -> float:
        return kernels.memory(params * (ADAM_BYTES_FP32_STATES + 4))

    emb = word_embedding_params(model) + (position_embedding_params(model) if model.add_position_embedding else 0)
    return {
        "pre": (pre.forward, pre.backward, adam(emb)),
        "layer": (layer.forward, layer.backward, adam(layer_params(model).total)),
        "post": (post.forward, post.backward, adam(word_embedding_params(model))),
    }


def compare(name: str, kernels: Kernels) -> list[str]:
    config, _ = parse_config([*MODELS[name], *COMMON, "--print-layout"], world_size=NUM_STAGES)
    model, mb = config.model, config.training.micro_batch_size
    cal = calibrate(model, mb)
    measured = {g.group: (g.forward, g.backward, g.optimizer) for g in cal.timings}
    f, b, o = measured["post"]
    measured["post"] = (f, b, o + cal.tied_copy_optimizer)  # the last stage's copy of the tied embedding
    guess = predicted(model, mb, kernels)
    lines = [f"model {name} (micro-batch {mb}; ms of CPU time, one thread): measured / predicted per group"]
    for group in ("pre", "layer", "post"):
        m, p = measured[group], guess[group]
        cells = "  ".join(f"{what} {a * 1e3:8.2f} / {b * 1e3:8.2f}" for what, a, b in zip(("fwd", "bwd", "opt"), m, p))
        lines.append(f"  {group:<5} {cells}  total pred/meas {sum(p) / sum(m):.3f}")
    m_total = config.training.global_batch_size // mb
    layers = config.model.num_layers
    per = [layers // NUM_STAGES + (1 if s < layers % NUM_STAGES else 0) for s in range(NUM_STAGES)]
    for label, table in (("measured", measured), ("predicted", guess)):
        stages = []
        for s, k in enumerate(per):
            held = [("layer", k)] + ([("pre", 1)] if s == 0 else []) + ([("post", 1)] if s == NUM_STAGES - 1 else [])
            stages.append(sum(n * (m_total * (table[g][0] + table[g][1]) + table[g][2]) for g, n in held))
        lines.append(f"  stock stages, {label:<9} ms per step: " + " ".join(f"{x * 1e3:8.1f}" for x in stages))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", metavar="FILE", help="store the profile (the planner's --kernel-profile FILE)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--models", nargs="*", default=["8-layer", "48-layer"], choices=sorted(MODELS))
    args = ap.parse_args(argv)
    profile = measure(args.device, args.precision)
    print("profile: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in profile.items()}))
    if args.write:
        Path(args.write).write_text(json.dumps(profile, indent=2) + "\n")
    kernels = Kernels.from_profile(profile)
    for name in args.models if args.device == "cpu" else []:
        print("\n".join(compare(name, kernels)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
