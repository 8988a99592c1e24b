#!/usr/bin/env python
"""Record the `args` Namespace that Megatron-LM's pretrain_gpt.py saves in its checkpoints, for the
launch lines in CONFIGS, by running Megatron-LM's own argument code (parse_args, validate_args and
build_tokenizer, which pads the vocabulary).

    python tools/capture_megatron_lm_args.py --megatron-lm PATH --out tests/data/megatron_lm_args.json

PATH is a checkout (or `git archive` export) of a Megatron-LM release; megatron_ds's tests use
core_v0.16.1, the megatron-core release installed here. Its tokenizer code needs `six`
(`pip install six`). `megatron.core.transformer.custom_layers.batch_invariant_kernels` imports
triton at import time and is replaced by an empty module (nothing in argument parsing uses it); the
GPU architecture, asked only to choose a warning when T > 1, is answered as Hopper's (9).
The result is the input of `megatron_ds.testing.megatron_lm_checkpoints`, which writes Megatron-LM
checkpoints with megatron-core for the conversion tests. Values JSON cannot hold are tagged:
torch dtypes as {"torch.dtype": name}, Megatron's enums as {"enum": "module.Class", "name": name}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_COMMON = (
    "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 "
    "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 "
    "--tokenizer-type NullTokenizer --vocab-size 100 --hidden-dropout 0 --attention-dropout 0"
)
CONFIGS: dict[str, tuple[int, str]] = {
    "gpt": (1, "--num-layers 2 --hidden-size 32 --num-attention-heads 4 " + _COMMON),
    "llama": (
        2,
        "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--ffn-hidden-size 48 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear "
        "--position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights "
        "--tensor-model-parallel-size 2 --bf16 " + _COMMON,
    ),
    "gpt_pp2": (
        2,
        "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --pipeline-model-parallel-size 2 " + _COMMON,
    ),
    "converted": (
        1,
        "--num-layers 2 --hidden-size 32 --seq-length 32 --num-experts 0 --num-attention-heads 4 "
        "--max-position-embeddings 32 --position-embedding-type rope --tokenizer-type NullTokenizer --vocab-size 100 "
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 1 "
        "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
        "--no-async-tensor-model-parallel-allreduce --use-cpu-initialization --micro-batch-size 1 --no-load-optim "
        "--no-load-rng --no-save-optim --no-save-rng --no-initialization --save-interval 1 --save /tmp/converted "
        "--ckpt-format torch --no-one-logger --make-vocab-size-divisible-by 128 --bf16 --disable-bias-linear",
    ),
    "mixtral": (
        2,
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--ffn-hidden-size 48 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear "
        "--position-embedding-type rope --untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 "
        "--moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather " + _COMMON,
    ),
    "mixtral_tp2": (
        4,
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--ffn-hidden-size 48 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear "
        "--position-embedding-type rope --untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 "
        "--moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather "
        "--tensor-model-parallel-size 2 --sequence-parallel --bf16 --moe-router-dtype fp32 " + _COMMON,
    ),
}
"""name -> (world size, launch line): a GPT-3-style model (learned positions, LayerNorm, GeLU, biases,
tied output), a Llama-style one (rotary, RMSNorm, SwiGLU, grouped-query attention, no biases, untied
output, bf16, two tensor-parallel ranks), and the GPT on two pipeline stages (the tied output layer on
the last one), and the line Megatron-LM's checkpoint converter (tools/checkpoint/saver_base.py) builds
for the model it writes (no training length, no learning rate, `--num-experts 0`), and a Mixtral-style
mixture of experts (the Llama's layers with 4 SwiGLU experts per layer, top-2 routing with the auxiliary
load-balancing loss, fp32) on two expert-parallel ranks (2 experts each; T = P = 1, so 2 data-parallel
ranks) with the allgather token dispatcher, and the same at T = 2 (its experts split over both tensor ranks,
Megatron-LM's default --expert-tensor-parallel-size; --sequence-parallel, which Megatron-LM requires of MoE at
T > 1; bf16 with the router in fp32) on 4 ranks."""

_CHILD = r"""
import json, sys, types, importlib.machinery, enum
import torch
stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
stub.__spec__ = importlib.machinery.ModuleSpec(stub.__name__, None)
stub.enable_batch_invariant_mode = stub.disable_batch_invariant_mode = lambda *a, **k: None
stub.is_batch_invariant_mode_enabled = lambda: False
sys.modules[stub.__name__] = stub
import megatron.training.arguments as arguments
from megatron.training.arguments import parse_args, validate_args
arguments.get_device_arch_version = lambda: 9  # a Hopper GPU: asked only for a warning with T > 1
from megatron.training.tokenizer import build_tokenizer
sys.argv = ["pretrain_gpt.py"] + json.loads(sys.stdin.read())
args = parse_args()
validate_args(args, {})
build_tokenizer(args)
def tag(v):
    if isinstance(v, torch.dtype):
        return {"torch.dtype": str(v).removeprefix("torch.")}
    if isinstance(v, enum.Enum):
        return {"enum": f"{type(v).__module__}.{type(v).__qualname__}", "name": v.name}
    if isinstance(v, (list, tuple)):
        return [tag(x) for x in v]
    return v
print("ARGS=" + json.dumps({k: tag(v) for k, v in vars(args).items()}, sort_keys=True))
"""


def capture(checkout: str, world_size: int, line: str) -> dict[str, object]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")]),
        "WORLD_SIZE": str(world_size),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(line.split()),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    found = [x for x in done.stdout.splitlines() if x.startswith("ARGS=")]
    if done.returncode or not found:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"Megatron-LM's argument code failed for {line!r}: {tail}")
    return json.loads(found[0].removeprefix("ARGS="))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if not os.path.isfile(os.path.join(a.megatron_lm, "megatron", "training", "arguments.py")):
        raise SystemExit(
            f"--megatron-lm {a.megatron_lm}: no megatron/training/arguments.py; give a Megatron-LM checkout"
        )
    out = {
        name: {"world_size": world, "argv": line.split(), "args": capture(a.megatron_lm, world, line)}
        for name, (world, line) in CONFIGS.items()
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{a.out}: {', '.join(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
